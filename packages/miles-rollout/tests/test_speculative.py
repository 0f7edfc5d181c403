"""CPU tier, in-process engine: speculative decoding with the model's MTP draft (speculative.py).

What a user relies on: with the draft on, the engine emits exactly what it emits without it — tokens, log-probs,
top log-probs, finish reasons, texts — at temperature 0 and at temperature > 0 with seeds (deterministic mode),
when EOS, a stop token, a stop string or max_new_tokens falls inside an accepted run, across retract / resume, for
dense and MoE models. The random MTP head of a test model is rarely right, so an oracle draft (the reference
continuation, wrong at some positions) drives long accepted runs and rejections; the real draft's rows are checked
against the offline MTP forward (`CausalLM.mtp_hidden`), which proves its K/V bookkeeping (extend, rollback). A
checkpoint saved by transformers (config.json declares an MTP layer, no tensor of it) is served without a draft.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import (
    KernelConfig,
    RowSampling,
    broadcast_tensors,
    build_packed_batch,
    checkpoint_tensors,
    dtype_name,
    init_weight_update_group,
    iter_buckets,
    load_model,
    read_model_config,
    sample,
)
from miles_kernels.testing import build_tokenizer, save_random_model, save_transformers_model, tiny_config
from miles_rollout import Engine, EngineConfig, InProcessClient, free_port
from miles_rollout.draft_tree import DraftTree

PROMPTS = [[(3 * i + 1) % 500 for i in range(21)], [7, 8, 9], [(11 * i) % 500 for i in range(32)]]  # 32: whole pages
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}


def wrong_every_fourth(sample: int, position: int) -> bool:
    """The oracle's proposals are wrong at every position p with (sample index + p) % 4 == 0: long accepted runs,
    and rejections at every draft position."""
    return (sample + position) % 4 == 0


@pytest.fixture(scope="module", params=["dense", "moe"])
def mtp_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(f"mtp-{request.param}")
    config = tiny_config(request.param, vocab_size=512, max_position_embeddings=512, num_nextn_predict_layers=1)
    save_random_model(directory, config, seed=1, tokenizer=build_tokenizer(save_dir=directory))
    return directory


def make_engine(model_dir: Path, **engine: object) -> Engine:
    return Engine(str(model_dir), KernelConfig(mode="deterministic", page_size=16), EngineConfig(num_kv_pages=128,
                  **engine))  # type: ignore[arg-type]  # fmt: skip


def generate(engine: Engine, params: dict, prompts: list[list[int]] = PROMPTS) -> list:
    request = GenerateRequest(
        input_ids=prompts, sampling_params=SamplingParams(**params), return_logprob=True, top_logprobs_num=2
    )
    return asyncio.run(InProcessClient(engine).generate(request))


def summary(responses: list) -> list:
    """Everything a response says about its tokens (not its timing or speculative counts)."""
    return [
        (r.output_ids, r.text, r.meta_info.finish_reason, r.meta_info.output_token_logprobs,
         r.meta_info.output_top_logprobs, r.meta_info.completion_tokens, r.meta_info.weight_version)
        for r in responses
    ]  # fmt: skip


def test_a_chain_keeps_the_agreeing_prefix_and_the_targets_token() -> None:
    def emitted(drafts: list[int], targets: list[int]) -> list[int]:
        return [targets[node] for node in DraftTree.chain(0, drafts).accept_path(targets)]

    assert emitted([], [5]) == [5]
    assert emitted([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted: the bonus token
    assert emitted([1, 2, 3], [1, 9, 3, 4]) == [1, 9]  # the target's token at the first disagreement
    assert emitted([1, 2, 3], [7, 2, 3, 4]) == [7]


FILTERED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 30, "sampling_seed": 5,
            "repetition_penalty": 1.2, "frequency_penalty": 0.3, "min_new_tokens": 5}  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "max_new_tokens": 40, "n": 2},
        {"temperature": 1.0, "max_new_tokens": 40, "n": 2, "sampling_seed": 3},
        FILTERED,
    ],
    ids=["greedy", "seeded", "filtered-penalized"],
)
def test_outputs_are_identical_with_and_without_the_draft(mtp_dir: Path, params: dict, oracle_drafter) -> None:
    plain = make_engine(mtp_dir)
    reference = generate(plain, params)
    plain.shutdown()
    speculative = make_engine(mtp_dir, **SPEC)
    try:
        responses = generate(speculative, params)
        assert summary(responses) == summary(reference)
        continuations = {(tuple(p), seq): r.output_ids for p, seq, r in _keys(responses, params)}
        speculative.scheduler.drafter = oracle_drafter(
            speculative.scheduler.drafter, continuations, wrong_every_fourth
        )
        oracle = generate(speculative, params)
        assert summary(oracle) == summary(reference)
        counts = [r.meta_info for r in oracle]
        assert sum(m.spec_num_correct_drafts for m in counts) > sum(m.spec_num_proposed_drafts for m in counts) / 2
        assert any(len(m.spec_accept_histogram) == 4 for m in counts)  # runs of 3 accepted drafts happened
    finally:
        speculative.shutdown()


def _keys(responses: list, params: dict) -> list:
    """(prompt, sample index, response) of prompt-major responses."""
    n = params.get("n", 1)
    return [(PROMPTS[i // n], i % n, response) for i, response in enumerate(responses)]


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(mtp_dir: Path, oracle_drafter) -> None:
    """EOS-like stop tokens, stop strings and max_new_tokens placed inside runs the oracle draft gets accepted."""
    plain = make_engine(mtp_dir)
    base = {"temperature": 1.0, "max_new_tokens": 48, "sampling_seed": 11, "ignore_eos": True}
    free = generate(plain, base)
    cases = [
        {**base, "stop_token_ids": [free[0].output_ids[17], free[2].output_ids[9]]},
        {**base, "stop": [free[0].text[20:23], free[1].text[31:33]]},
        {**base, "stop": [free[0].text[20:23]], "no_stop_trim": True},
        {**base, "max_new_tokens": 13},
        {**base, "ignore_eos": False, "max_new_tokens": 48},
    ]
    references = [generate(plain, params) for params in cases]
    plain.shutdown()
    speculative = make_engine(mtp_dir, **SPEC)
    continuations = {(tuple(p), seq): r.output_ids for p, seq, r in _keys(free, base)}
    speculative.scheduler.drafter = oracle_drafter(speculative.scheduler.drafter, continuations, wrong_every_fourth)
    try:
        for params, reference in zip(cases, references, strict=True):
            responses = generate(speculative, params)
            assert summary(responses) == summary(reference), params
            assert sum(r.meta_info.spec_num_correct_drafts or 0 for r in responses) > 0, params  # runs were accepted
    finally:
        speculative.shutdown()


def test_retract_and_resume_with_the_draft_continue_exactly(mtp_dir: Path) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 50, "n": 2, "sampling_seed": 7, "ignore_eos": True}
    plain = make_engine(mtp_dir)
    reference = generate(plain, params)
    plain.shutdown()
    engine = make_engine(mtp_dir, **SPEC)

    async def paused_midway() -> list:
        client = InProcessClient(engine)
        request = GenerateRequest(input_ids=PROMPTS, sampling_params=SamplingParams(**params), return_logprob=True,
                                  top_logprobs_num=2)  # fmt: skip
        task = asyncio.create_task(client.generate(request))
        await engine.wait_until(lambda s: s["num_running"] == 6 and s["num_generated_tokens"] >= 6 * 10)
        assert await engine.control(lambda: engine.pause_generation("retract"), needs_idle=False) == 3
        await engine.control(engine.continue_generation, needs_idle=False)
        return await task

    try:
        responses = asyncio.run(paused_midway())
        assert summary(responses) == summary(reference)
        assert all(r.meta_info.spec_verify_ct for r in responses)  # the draft ran, before and after the retract
    finally:
        engine.shutdown()


def test_the_engines_drafts_are_the_offline_mtp_forwards(mtp_dir: Path) -> None:
    """With one draft step, every draft comes from exact draft K/V: it must equal the MTP head's sample computed
    offline over the finished sequence (trunk hidden states of the packed forward, then `mtp_hidden`), at every
    position the engine drafted — after rejections, rollbacks and accepted runs alike."""
    engine = make_engine(mtp_dir, speculative_algorithm="NEXTN", speculative_num_steps=1)
    proposed: list[tuple[list[int], int, int]] = []  # (sequence tokens so far, seed, draft)
    drafter = engine.scheduler.drafter
    original = drafter.propose

    def recording(store, seqs, budgets):  # type: ignore[no-untyped-def]
        drafts = original(store, seqs, budgets)
        proposed.extend((list(seq.tokens), seq.seed, d[0]) for seq, d in zip(seqs, drafts, strict=True) if d)
        return drafts

    drafter.propose = recording  # type: ignore[method-assign]
    params = {"temperature": 1.0, "max_new_tokens": 30, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    try:
        responses = generate(engine, params)
    finally:
        engine.shutdown()
    model = load_model(str(mtp_dir), KernelConfig(mode="deterministic", page_size=16))
    assert len(proposed) > 50 and len(responses) == 6
    with torch.no_grad():
        for full, seed, draft in proposed:
            # The draft scores token len(full) from the MTP row at len(full) - 2: the trunk's hidden state there
            # and the sequence's last token.
            length = len(full) - 1
            batch = build_packed_batch([length], 16, model.kernel.attention_query_tile)
            hidden = model.forward_hidden(torch.tensor(full[:length]), batch)
            out = model.mtp_hidden(hidden, torch.tensor(full[1 : length + 1]), batch)
            row = RowSampling(temperature=params["temperature"], seed=seed, position=len(full))
            assert int(sample(model.mtp_logits(out[-1:]), [row])) == draft, (len(full), seed)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"speculative_algorithm": "NGRAM"}, "STANDALONE and NGRAM are not implemented"),
        (
            {
                "speculative_algorithm": "NEXTN",
                "speculative_eagle_topk": 2,
                "speculative_num_steps": 2,
                "speculative_num_draft_tokens": 8,
            },
            r"at most 1 \+ 2 \+ 1 x 2\^2 = 7",
        ),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_num_draft_tokens": 5}, "= 3"),
        ({"speculative_num_steps": 2}, "add speculative_algorithm=NEXTN"),
    ],
)
def test_speculative_settings_are_checked(engine: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**engine)
    assert EngineConfig(speculative_algorithm="eagle", speculative_eagle_topk=1).num_draft_steps == 3
    assert EngineConfig(speculative_algorithm="NEXTN", speculative_num_draft_tokens=4).num_draft_steps == 3


def test_serve_refuses_bad_speculative_flags_and_models_without_mtp(dense_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from miles_rollout.cli import main

    assert main(["serve", "--model-path", str(dense_dir), "--speculative-algorithm", "NEXTN"]) == 2
    assert "has none (num_nextn_predict_layers = 0" in capsys.readouterr().err
    assert main(["serve", "--model-path", str(dense_dir), "--speculative-algorithm", "NEXTN",
                 "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "99"]) == 2  # fmt: skip
    assert "speculative_num_draft_tokens=99: a tree of" in capsys.readouterr().err


def test_the_server_speaks_sglangs_speculative_fields(mtp_dir: Path) -> None:
    """Over HTTP: SGLang's flags start it, SGLang's keys come back in meta_info and /get_server_info."""
    import httpx

    from miles_rollout.launch import launch_server

    flags = (
        "--page-size",
        "16",
        "--num-kv-pages",
        "128",
        "--deterministic",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    )
    with launch_server(mtp_dir, *flags, env={"OMP_NUM_THREADS": "1"}) as url:
        body = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        }
        meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert meta["spec_verify_ct"] >= 1 and meta["spec_num_proposed_drafts"] >= meta["spec_num_correct_drafts"]
    assert meta["spec_accept_length"] == 1 + meta["spec_num_correct_drafts"] / meta["spec_verify_ct"]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_num_draft_tokens"]) == (
        "NEXTN", 2, 3)  # fmt: skip
    assert len(info["spec_accept_rate_by_position"]) == 2 and info["spec_num_verify"] == meta["spec_verify_ct"]


def test_the_drafts_weights_travel_with_every_weight_update(mtp_dir: Path, tmp_path: Path) -> None:
    """From disk, in buckets, as in-process tensors and by a gloo broadcast, the MTP module's weights are updated
    with the trunk's: afterwards the engine drafts exactly as a fresh engine on the new weights does (same accept
    counts)."""
    other = tmp_path / "other"
    save_random_model(other, read_model_config(mtp_dir), seed=7, tokenizer=build_tokenizer(save_dir=other))
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5}

    def drafted(engine: Engine) -> list:
        return [(r.output_ids, r.meta_info.spec_verify_ct, r.meta_info.spec_num_correct_drafts)
                for r in generate(engine, params)]  # fmt: skip

    references = {}
    for name, directory in (("mtp", mtp_dir), ("other", other)):
        fresh = make_engine(directory, **SPEC)
        references[name] = drafted(fresh)
        fresh.shutdown()
    assert [r[1:] for r in references["mtp"]] != [r[1:] for r in references["other"]]  # the drafts differ
    engine = make_engine(mtp_dir, **SPEC)
    client = InProcessClient(engine)
    try:
        asyncio.run(client.update_weights_from_disk(str(other), weight_version=1))
        assert drafted(engine) == references["other"]
        tensors = list(checkpoint_tensors(load_model(mtp_dir)).items())
        asyncio.run(client.update_weights_from_buckets(iter_buckets(tensors, version=2, bucket_bytes=20_000)))
        assert drafted(engine) == references["mtp"]
        tensors_once = checkpoint_tensors(load_model(other), mtp_copies=False)  # the local cluster's copy
        asyncio.run(engine.control(lambda: engine.weights.load_tensors(tensors_once, version=3), needs_idle=True))
        assert drafted(engine) == references["other"]
        broadcast = checkpoint_tensors(load_model(mtp_dir), mtp_copies=False)  # torch.distributed, over gloo
        names, port = list(broadcast), free_port()
        holder: dict[str, Any] = {}
        host = threading.Thread(
            target=lambda: holder.setdefault("group", init_weight_update_group("127.0.0.1", port, 0, 2))
        )
        host.start()
        asyncio.run(client.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2))
        host.join(timeout=60)
        sender = threading.Thread(
            target=lambda: broadcast_tensors(holder["group"], [broadcast[n] for n in names], src=0)
        )
        sender.start()
        dtypes, shapes = [dtype_name(broadcast[n].dtype) for n in names], [list(broadcast[n].shape) for n in names]
        asyncio.run(client.update_weights_from_distributed(names, dtypes, shapes, weight_version=4))
        sender.join(timeout=60)
        assert drafted(engine) == references["mtp"]
    finally:
        engine.shutdown()


def test_a_glm45_saved_by_transformers_is_served_without_a_draft(tmp_path: Path) -> None:
    """Its config.json declares an MTP layer that transformers did not write: the engine serves the trunk, decoding
    without a draft, and asking for one is refused with the reason."""
    config = tiny_config("glm", vocab_size=512, max_position_embeddings=512, num_nextn_predict_layers=1)
    save_transformers_model(tmp_path, config, seed=1, tokenizer=build_tokenizer(save_dir=tmp_path))
    engine = make_engine(tmp_path)
    try:
        assert engine.model.mtp_layers == []
        responses = generate(engine, {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    finally:
        engine.shutdown()
    assert [len(r.output_ids) for r in responses] == [6] * len(PROMPTS)
    assert all(not r.meta_info.spec_verify_ct for r in responses)
    with pytest.raises(ValueError, match=r"has none \(num_nextn_predict_layers = 0 in config.json, or MTP layers it"):
        make_engine(tmp_path, **SPEC)
