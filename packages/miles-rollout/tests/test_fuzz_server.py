"""Multi-process tier, property-based (hypothesis): generated hostile requests against ONE real `miles-rollout serve`
process over real HTTP — random JSON values; bodies shaped like a `/generate`, `/v1/completions` or
`/v1/chat/completions` request with random values and magnitudes, some with one field of a wrong type; random bytes
with random content types and headers (Authorization included, non-ASCII too); random bodies and queries for the
admin routes (a pause, an open weight update or a memory release is always undone; weights are only ever loaded
from the served checkpoint, LoRA adapters only from directories that do not exist). Every answer, and every event of
a streamed one, is below 500; and fixed deterministic requests give the same output ids and log-probs before and
after each barrage, so nothing a request did leaked into the engine's state.

Generation stays cheap: `max_new_tokens` is 0-4 (or a value the server refuses), `n` 1-2, prompts short. The examples
are derandomized (the same ones every run, so a failure reproduces); raise `max_examples` or drop `derandomize`
locally to explore further."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_rollout.launch import launch_server

API_KEY, ADMIN_KEY = "fuzz-api-key", "fuzz-admin-key"
JSON_HEADERS = {"Content-Type": "application/json"}
USER = {"Authorization": f"Bearer {API_KEY}", **JSON_HEADERS}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}", **JSON_HEADERS}
SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# Requests whose outputs must not change: greedy, and sampled with a seed.
PROBES = [
    {"input_ids": [3, 1, 4, 1, 5], "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    {
        "text": "probe",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 11, "n": 2},
    },
]
# The calls that change the server's mode, and the bare call that undoes each.
UNDO = {
    "/pause_generation": "/continue_generation",
    "/begin_weight_update": "/end_weight_update",
    "/release_memory_occupation": "/resume_memory_occupation",
}


@dataclass
class Server:
    client: httpx.Client
    model_dir: Path  # the served checkpoint: what released weights are reloaded from


@pytest.fixture(scope="module")
def server(dense_dir: Path) -> Iterator[Server]:
    flags = ("--page-size", "16", "--num-kv-pages", "512", "--deterministic", "--enable-lora")
    with (
        launch_server(dense_dir, *flags, env={"OMP_NUM_THREADS": "1"}, api_key=API_KEY, admin_key=ADMIN_KEY) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        yield Server(client, dense_dir)


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity too: Python's json.loads reads them


def send(server: Server, method: str, path: str, content: bytes, headers: dict[Any, Any]) -> httpx.Response:
    """One request, read to its end (a stream too); a 5xx status or a 5xx error event fails the test."""
    with server.client.stream(method, path, content=content, headers=headers) as response:
        body = response.read()
    assert response.status_code < 500, (method, path, content[:300], headers, response.status_code, body[:300])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in body.split(b"\n"):
            if line.startswith(b"data: {"):
                error = json.loads(line[6:]).get("error")
                assert error is None or int(error.get("code") or 0) < 500, (path, content[:300], error)
    return response


def undo(server: Server, path: str) -> None:
    """Undo what a call to `path` may have done (a pause, an open weight update, released memory)."""
    assert send(server, "POST", UNDO[path], b"", {"Authorization": f"Bearer {ADMIN_KEY}"}).status_code < 500
    if path == "/release_memory_occupation":  # released weights come back empty: reload the served checkpoint
        body = encode({"model_path": str(server.model_dir)})
        assert send(server, "POST", "/update_weights_from_disk", body, ADMIN).status_code == 200


def probe(server: Server) -> list[Any]:
    outputs = []
    for body in PROBES:
        response = server.client.post("/generate", content=encode(body), headers=USER)
        assert response.status_code == 200, response.text
        answers = response.json() if isinstance(response.json(), list) else [response.json()]
        outputs += [(a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in answers]
    return outputs


def unchanged_by(server: Server, barrage: Callable[[], None]) -> None:
    """Run `barrage`; the probes' outputs are the same bits afterwards."""
    before = probe(server)
    barrage()
    for path in UNDO:  # leave the server as found, whatever the barrage did
        undo(server, path)
    assert probe(server) == before


# -- strategies: plausible values (edge magnitudes included), and junk for one field at a time ---------------------


def huge_ints() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(min_value=2**20 + 1, max_value=10**40), st.integers(max_value=-1, min_value=-(10**40))
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    huge_ints(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.none(), max_size=2),
    JSON_VALUES,
)
IDS = st.lists(st.integers(0, 511), min_size=1, max_size=6)
TEXT = st.text(min_size=1, max_size=16)
PENALTY = st.one_of(st.floats(-2, 2), st.sampled_from([-2.0, 2.0, -0.0, 1e-300]))
REGEX = st.one_of(
    st.sampled_from(["a+", "[0-9]{2}", "(x|y)*z", "([a-z", ".*", "\\b", "(?P<x>a)"]), st.text(max_size=8)
)
SCHEMA = st.one_of(
    st.sampled_from(
        [
            '{"type": "integer"}',
            '{"type": "object"}',
            '{"enum": ["a", "b"]}',
            '{"type": "string", "maxLength": 2}',
            '{"type": "array", "items": {"type": "boolean"}}',
            "{}",
            "{not json",
            "[]",
        ]
    ),
    JSON_VALUES.map(json.dumps),
)
LOGIT_BIAS = st.dictionaries(
    st.integers(0, 511).map(str), st.one_of(st.floats(-100, 100), st.sampled_from([1e308, -1e308])), max_size=3
)


def optional_fields(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def with_junk(valid: st.SearchStrategy[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Mostly `valid`; sometimes one of `keys` set to junk (a wrong type, a refused magnitude). (Arbitrary JSON
    bodies are `test_random_bytes_and_headers`'.)"""
    mutated = st.builds(lambda body, key, junk: {**body, key: junk}, valid, st.sampled_from(keys), JUNK)
    return st.one_of(valid, valid, valid, mutated)


SAMPLING_FIELDS = dict(
    temperature=st.one_of(st.floats(0, 2), st.floats(0, 100), st.sampled_from([0.0, 1e-300, 100.0])),
    top_p=st.floats(1e-9, 1),
    top_k=st.one_of(st.just(-1), st.integers(1, 600), st.integers(600, 2**63)),
    min_p=st.floats(0, 1),
    stop=st.one_of(TEXT, st.lists(st.text(max_size=4), max_size=3)),
    stop_token_ids=st.lists(st.integers(0, 511), max_size=3),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    no_stop_trim=st.booleans(),
    n=st.integers(1, 2),
    min_new_tokens=st.integers(0, 1),
    repetition_penalty=st.one_of(st.floats(0.01, 2), st.sampled_from([1e-300, 2.0])),
    frequency_penalty=PENALTY,
    presence_penalty=PENALTY,
    sampling_seed=st.integers(0, 2**64 + 5),
    spaces_between_special_tokens=st.booleans(),
    logit_bias=LOGIT_BIAS,
    stop_regex=st.one_of(REGEX, st.lists(REGEX, max_size=2)),
    custom_params=st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=2),
)
GRAMMARS = dict(  # at most one per request
    json_schema=SCHEMA, regex=REGEX, ebnf=st.sampled_from(['root ::= "a"', "root ::= ", "root ::= [0-9]+", "x"])
)
SAMPLING = st.builds(
    lambda rest, grammar, max_new_tokens: {**rest, **grammar, "max_new_tokens": max_new_tokens},
    optional_fields(**SAMPLING_FIELDS),
    st.one_of(st.just({}), *(st.fixed_dictionaries({key: value}) for key, value in GRAMMARS.items())),
    st.one_of(st.integers(1, 4), st.integers(1, 4), st.just(0)),
)
SAMPLING_KEYS = [*SAMPLING_FIELDS, *GRAMMARS, "max_new_tokens", "temprature", "beam_width"]
GENERATE_FIELDS = dict(
    return_logprob=st.booleans(),
    logprob_start_len=st.integers(-1, 3),
    top_logprobs_num=st.one_of(st.integers(0, 5), st.integers(0, 5), st.integers(6, 10**6)),
    return_text_in_logprobs=st.booleans(),
    stream=st.booleans(),
    rid=st.text(min_size=1, max_size=6),
    routed_experts_start_len=st.integers(0, 4),
    model=st.just("default"),
)
GENERATE = with_junk(
    st.builds(
        lambda prompt, sampling, rest: {**rest, **prompt, "sampling_params": sampling},
        st.one_of(
            st.fixed_dictionaries({"input_ids": st.one_of(IDS, st.lists(IDS, min_size=1, max_size=3))}),
            st.fixed_dictionaries({"text": st.one_of(TEXT, st.lists(st.text(max_size=8), min_size=1, max_size=3))}),
        ),
        st.one_of(SAMPLING, with_junk(SAMPLING, SAMPLING_KEYS)),
        optional_fields(**GENERATE_FIELDS),
    ),
    [
        *GENERATE_FIELDS,
        "input_ids",
        "text",
        "sampling_params",
        "return_routed_experts",
        "image_data",
        "lora_path",
        "return_hidden_states",
        "session_params",
    ],
)
OPENAI_FIELDS = dict(
    model=st.sampled_from(["default", "default", "default", "gpt-4"]),
    n=st.integers(1, 2),
    temperature=st.floats(0, 2),
    top_p=st.floats(1e-9, 1),
    stop=st.one_of(TEXT, st.lists(TEXT, max_size=2)),
    seed=st.integers(0, 2**70),
    frequency_penalty=PENALTY,
    presence_penalty=PENALTY,
    top_k=st.one_of(st.just(-1), st.integers(1, 10**6)),
    min_p=st.floats(0, 1),
    min_tokens=st.integers(0, 2),
    repetition_penalty=st.floats(0.01, 2),
    stop_token_ids=st.lists(st.integers(0, 511), max_size=3),
    ignore_eos=st.booleans(),
    stream=st.booleans(),
    stream_options=st.fixed_dictionaries({"include_usage": st.booleans()}),
    response_format=st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries(
            {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": JSON_VALUES})}
        ),
    ),
    logit_bias=LOGIT_BIAS,
    regex=REGEX,
    user=st.text(max_size=4),
    rid=st.text(min_size=1, max_size=6),
)
OPENAI_REFUSED = ["best_of", "suffix", "tools", "functions"]
MAX_TOKENS = st.integers(1, 4)
COMPLETION = with_junk(
    st.builds(
        lambda prompt, max_tokens, rest: {**rest, "prompt": prompt, "max_tokens": max_tokens},
        st.one_of(TEXT, IDS, st.lists(IDS, min_size=1, max_size=2), st.lists(TEXT, min_size=1, max_size=2)),
        MAX_TOKENS,
        optional_fields(**OPENAI_FIELDS, logprobs=st.integers(0, 5), echo=st.booleans()),
    ),
    [*OPENAI_FIELDS, "prompt", "max_tokens", "logprobs", "echo", "lora_path", *OPENAI_REFUSED],
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "user", "assistant", "tool", "developer"]),
        "content": st.one_of(
            TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
        ),
    },
    optional={"name": st.text(max_size=4)},
)
CHAT_FIELDS = dict(
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 5),
    continue_final_message=st.booleans(),
    max_completion_tokens=MAX_TOKENS,
    chat_template_kwargs=st.fixed_dictionaries({"enable_thinking": st.booleans()}),
)
CHAT = with_junk(
    st.builds(
        lambda messages, max_tokens, rest: {**rest, "messages": messages, "max_tokens": max_tokens},
        st.lists(MESSAGE, min_size=1, max_size=3),
        MAX_TOKENS,
        optional_fields(**OPENAI_FIELDS, **CHAT_FIELDS),
    ),
    [*OPENAI_FIELDS, *CHAT_FIELDS, "messages", "max_tokens", "echo", "lora_path", *OPENAI_REFUSED],
)

# JSON that Python's json.loads refuses with something other than a JSONDecodeError.
HOSTILE_JSON = st.one_of(
    st.integers(4301, 6000).map(lambda digits: b"7" * digits),  # ValueError: over 4300 digits
    st.integers(1000, 40_000).map(lambda depth: b"[" * depth + b"]" * depth),  # RecursionError
    st.integers(1000, 40_000).map(
        lambda depth: b'{"text": "a", "custom_params": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    ),
    st.binary(min_size=1, max_size=8).map(lambda raw: b'{"text": "' + raw + b'"}'),  # not UTF-8
)
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"), max_size=24)


def header_value(text: str) -> bytes:
    """Header bytes h11 sends (no control characters, no surrounding space): latin-1 where it fits, else UTF-8."""
    stripped = text.strip(" \t") or "x"
    try:
        return stripped.encode("latin-1")
    except UnicodeEncodeError:
        return stripped.encode()


CONTENT_TYPE = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "text/plain",
            "application/octet-stream",
            "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded",
            "APPLICATION/JSON;",
        ]
    ),
    HEADER_TEXT,
)
HEADERS = optional_fields(
    Authorization=st.one_of(
        st.just(f"Bearer {API_KEY}"),
        st.just(f"Bearer {API_KEY}"),
        st.just(f"Bearer {ADMIN_KEY}"),
        st.just("Bearer é"),
        HEADER_TEXT.map(lambda t: f"Bearer {t}"),
        HEADER_TEXT,
    ),
    Origin=st.sampled_from(["https://evil.example", "null", "http://localhost", "http://127.0.0.1:1", "::"]),
    **{
        "Sec-Fetch-Site": st.sampled_from(["cross-site", "same-site", "same-origin", "none", "junk"]),
        "Host": st.sampled_from(["evil.example", "localhost", "127.0.0.1:80", "[::1]", "[::1", ":::", "a:b:c"]),
        "Accept": HEADER_TEXT,
        "X-Request-Id": HEADER_TEXT,
    },
).map(lambda headers: {name.encode(): header_value(value) for name, value in headers.items()})

ROUTES = [
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/flush_cache",
    "/abort_request",
    "/update_weight_version",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    *UNDO,
    *UNDO.values(),
    "/get_model_info",
    "/v1/models",
    "/nope",
]
ADMIN_BODIES = {
    "/flush_cache": st.just({}),
    "/abort_request": optional_fields(rid=st.text(max_size=4), abort_all=st.booleans()),
    "/update_weight_version": optional_fields(
        new_version=st.one_of(st.integers(0, 10), huge_ints()), abort_all_requests=st.booleans()
    ),
    "/update_weights_from_disk": st.builds(  # never a path that exists
        lambda path, rest: {**rest, "model_path": path},
        st.one_of(st.text(max_size=8).map(lambda t: f"/nonexistent-fuzz/{t}"), st.integers(), st.none()),
        optional_fields(
            weight_version=st.integers(-1, 10),
            load_format=st.sampled_from(["auto", "pt", "gguf"]),
            abort_all_requests=st.booleans(),
            is_async=st.booleans(),
            manifest=JSON_VALUES,
        ),
    ),
    "/update_weights_from_distributed": optional_fields(
        names=st.lists(st.text(max_size=6), max_size=2),
        dtypes=st.lists(st.text(max_size=6), max_size=2),
        shapes=st.lists(st.lists(st.integers(-1, 4), max_size=2), max_size=2),
        group_name=st.text(max_size=4),
    ),
    "/destroy_weights_update_group": optional_fields(group_name=st.text(max_size=4)),
    "/pause_generation": optional_fields(mode=st.sampled_from(["abort", "retract", "in_place", "x"])),
    "/continue_generation": optional_fields(torch_empty_cache=st.booleans()),
    "/begin_weight_update": optional_fields(
        selector=st.sampled_from(["all", "draft"]), weight_version=st.integers(-1, 10)
    ),
    "/end_weight_update": optional_fields(
        selector=st.sampled_from(["all", "draft"]), weight_version=st.integers(-1, 10)
    ),
    "/release_memory_occupation": optional_fields(tags=st.lists(st.sampled_from(["weights", "kv_cache", "x"]))),
    "/resume_memory_occupation": optional_fields(tags=st.lists(st.sampled_from(["weights", "kv_cache", "x"]))),
    "/load_lora_adapter": optional_fields(  # never a directory that exists
        lora_name=st.text(max_size=6),
        lora_path=st.one_of(st.text(max_size=8).map(lambda t: f"/nonexistent-fuzz/{t}"), st.just(""), st.integers()),
        pinned=st.booleans(),
        lora_id=st.text(max_size=4),
    ),
    "/unload_lora_adapter": optional_fields(lora_name=st.text(max_size=6)),
}
ADMIN_QUERIES = {
    "/flush_cache": optional_fields(
        timeout=st.one_of(st.floats(0, 0.05), st.sampled_from(["-1", "nan", "x", "1e999"]))
    ),
    "/weight_buckets": optional_fields(
        index=st.one_of(st.integers(0, 3), st.sampled_from(["-1", "x", str(10**30)])),
        bucket_bytes=st.one_of(st.integers(1, 1 << 24), st.sampled_from(["0", "-5", "x", str(10**30)])),
    ),
    "/weights_checksum": st.just({}),
}


# -- the barrages ------------------------------------------------------------------------------------------------


def test_generate_bodies(server: Server) -> None:
    @settings(SETTINGS, max_examples=100)
    @given(GENERATE)
    def barrage(body: Any) -> None:
        send(server, "POST", "/generate", encode(body), USER)

    unchanged_by(server, barrage)


def test_openai_bodies(server: Server) -> None:
    @settings(SETTINGS, max_examples=100)
    @given(
        st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION), st.tuples(st.just("/v1/chat/completions"), CHAT))
    )
    def barrage(case: tuple[str, Any]) -> None:
        path, body = case
        send(server, "POST", path, encode(body), USER)

    unchanged_by(server, barrage)


def test_random_bytes_and_headers(server: Server) -> None:
    @settings(SETTINGS, max_examples=60)
    @given(
        method=st.sampled_from(["POST", "POST", "GET", "PUT"]),
        path=st.sampled_from(ROUTES),
        content=st.one_of(
            st.binary(max_size=64), JSON_VALUES.map(encode), GENERATE.map(encode), st.just(b""), HOSTILE_JSON
        ),
        content_type=st.one_of(st.none(), CONTENT_TYPE),
        headers=HEADERS,
    )
    def barrage(method: str, path: str, content: bytes, content_type: str | None, headers: dict[bytes, bytes]) -> None:
        if content_type is not None:
            headers = {**headers, b"Content-Type": header_value(content_type)}
        send(server, method, path, content, headers)
        if path in UNDO:
            undo(server, path)

    unchanged_by(server, barrage)


def test_admin_routes(server: Server) -> None:
    @settings(SETTINGS, max_examples=60)
    @given(
        st.one_of(
            st.tuples(st.just("POST"), st.sampled_from(sorted(ADMIN_BODIES)), st.data()),
            st.tuples(st.just("GET"), st.sampled_from(sorted(ADMIN_QUERIES)), st.data()),
        )
    )
    def barrage(case: tuple[str, str, Any]) -> None:
        method, path, data = case
        if method == "GET":
            query = data.draw(ADMIN_QUERIES[path])
            response = server.client.get(path, params=query, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert response.status_code < 500, (path, query, response.text[:300])
            return
        body = data.draw(st.one_of(ADMIN_BODIES[path], ADMIN_BODIES[path], JSON_VALUES))
        send(server, "POST", path, encode(body), ADMIN)
        if path in UNDO:
            undo(server, path)

    unchanged_by(server, barrage)


def test_probes_are_finite_and_deterministic(server: Server) -> None:
    """The probes the barrages compare against are themselves reproducible (else the comparison means nothing)."""
    first, second = probe(server), probe(server)
    assert first == second and all(math.isfinite(lp) for _, entries in first for lp, *_ in entries)
