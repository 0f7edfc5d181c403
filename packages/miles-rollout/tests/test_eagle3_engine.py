"""CPU tier, in-process engine: speculative decoding with an EAGLE-3 draft (`--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR`, SpecForge's layout; speculative.py, miles_kernels/eagle3.py).

The guarantee is the MTP draft's: with the draft on, the engine emits exactly what it emits without it, at
temperature 0 and seeded temperature > 0, for dense, MoE and DeepSeek-V3 (MLA: the draft's plain K/V beside the
latent cache) targets. The draft has a reduced vocabulary (d2t / t2d)
here, so the draft's tokens map back to the target's. The engine's draft rows (K/V extend, rollback, recursion) are
checked against the draft's offline forward over the finished sequence.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import (
    KernelConfig,
    KVStore,
    RowSampling,
    build_attention_batch,
    eagle3_hidden,
    load_eagle3,
    load_model,
    new_eagle3,
    read_model_config,
    sample,
    save_eagle3,
)
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig, InProcessClient

PROMPTS = [[(3 * i + 1) % 500 for i in range(21)], [7, 8, 9], [(11 * i) % 500 for i in range(32)]]
KERNEL = KernelConfig(mode="deterministic", page_size=16)


@pytest.fixture(scope="module", params=["dense", "moe", "deepseek"])
def target_and_draft(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"eagle3-{request.param}")
    target = root / "target"
    config = tiny_config(request.param, vocab_size=512, max_position_embeddings=512, num_hidden_layers=4)
    save_random_model(target, config, seed=1, tokenizer=build_tokenizer(save_dir=target))
    counts = torch.zeros(512)
    counts[:400] = torch.arange(400, 0, -1)  # 300 draft tokens, the 300 lowest ids: d2t is not the identity
    counts[450] = 1000
    draft = new_eagle3(read_model_config(target), draft_vocab_size=300, token_counts_V=counts, seed=2)
    save_eagle3(draft, root / "draft")
    return target, root / "draft"


def make_engine(model_dir: Path, **engine: object) -> Engine:
    return Engine(str(model_dir), KERNEL, EngineConfig(num_kv_pages=128, **engine))  # type: ignore[arg-type]


def generate(engine: Engine, params: dict) -> list:
    request = GenerateRequest(input_ids=PROMPTS, sampling_params=SamplingParams(**params), return_logprob=True,
                              top_logprobs_num=2)  # fmt: skip
    return asyncio.run(InProcessClient(engine).generate(request))


def summary(responses: list) -> list:
    return [(r.output_ids, r.meta_info.finish_reason, r.meta_info.output_token_logprobs,
             r.meta_info.output_top_logprobs) for r in responses]  # fmt: skip


def wrong_every_fourth(sample: int, position: int) -> bool:
    return (sample + position) % 4 == 0


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0, "max_new_tokens": 40, "n": 2},
     {"temperature": 1.0, "max_new_tokens": 40, "n": 2, "sampling_seed": 3}],
    ids=["greedy", "seeded"],
)  # fmt: skip
def test_outputs_are_identical_with_and_without_the_eagle3_draft(
    target_and_draft: tuple[Path, Path], params: dict, oracle_drafter
) -> None:  # type: ignore[no-untyped-def]
    target, draft = target_and_draft
    plain = make_engine(target)
    reference = generate(plain, params)
    plain.shutdown()
    engine = make_engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                         speculative_num_steps=3)  # fmt: skip
    try:
        responses = generate(engine, params)
        assert summary(responses) == summary(reference)
        assert all(r.meta_info.spec_verify_ct for r in responses)
        n = params["n"]
        continuations = {(tuple(PROMPTS[i // n]), i % n): r.output_ids for i, r in enumerate(responses)}
        engine.scheduler.drafter = oracle_drafter(engine.scheduler.drafter, continuations, wrong_every_fourth)
        oracle = generate(engine, params)
        assert summary(oracle) == summary(reference)
        assert any(len(r.meta_info.spec_accept_histogram) == 4 for r in oracle)  # runs of 3 accepted drafts
    finally:
        engine.shutdown()


def test_the_engines_eagle3_drafts_are_the_offline_draft_forwards(target_and_draft: tuple[Path, Path]) -> None:
    """Two draft steps: the first draft of every step comes from exact draft K/V (rows computed from the trunk's
    features), the second from the draft's own output one row further. Both must equal the draft run offline over
    the sequence so far, in a fresh KV store."""
    target, draft_dir = target_and_draft
    engine = make_engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft_dir),
                         speculative_num_steps=2)  # fmt: skip
    proposed: list[tuple[list[int], int, list[int]]] = []
    drafter = engine.scheduler.drafter
    original = drafter.propose

    def recording(store, seqs, budgets):  # type: ignore[no-untyped-def]
        drafts = original(store, seqs, budgets)
        proposed.extend((list(seq.tokens), seq.seed, list(d)) for seq, d in zip(seqs, drafts, strict=True) if d)
        return drafts

    drafter.propose = recording  # type: ignore[method-assign]
    params = {"temperature": 1.0, "max_new_tokens": 24, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    try:
        generate(engine, params)
    finally:
        engine.shutdown()
    model = load_model(str(target), KERNEL)
    model.attach_eagle3(load_eagle3(draft_dir, model.config, KERNEL))
    assert model.eagle3 is not None
    checked = 0
    with torch.no_grad():
        for full, seed, drafts in proposed:
            length = len(full)
            store = KVStore.allocate(model.config, 8, 16, KERNEL.torch_dtype, "cpu", num_draft_layers=1,
                                     draft_kv=model.eagle3.kv_shape)  # fmt: skip
            pages = list(range(1, 8))
            batch = build_attention_batch([length], [0], [pages], 16, KERNEL.attention_query_tile)
            model.forward_hidden(torch.tensor(full), batch, store)
            features = model.last_draft_features
            assert features is not None
            # draft rows 0 .. length - 2 (row t: features at t, token t + 1); the last one drafts d_1
            rows = build_attention_batch([length - 1], [0], [pages], 16, KERNEL.attention_query_tile)
            out = eagle3_hidden(model, features[:-1], torch.tensor(full[1:]), rows, True, store)
            first = RowSampling(temperature=1.0, seed=seed, position=length)
            d1 = int(sample(model.eagle3.logits(out[-1:]), [first]))
            assert d1 == drafts[0], (length, seed)
            if len(drafts) > 1:
                step = build_attention_batch([1], [length - 1], [pages], 16, KERNEL.attention_query_tile)
                out2 = eagle3_hidden(model, out[-1:], torch.tensor([d1]), step, False, store)
                second = RowSampling(temperature=1.0, seed=seed, position=length + 1)
                assert int(sample(model.eagle3.logits(out2), [second])) == drafts[1], (length, seed)
                checked += 1
    assert checked > 20


def test_eagle3_settings_and_drafts_are_checked(target_and_draft: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="set speculative_draft_model_path"):
        EngineConfig(speculative_algorithm="EAGLE3")
    with pytest.raises(ValueError, match="set speculative_algorithm=EAGLE3"):
        EngineConfig(speculative_algorithm="NEXTN", speculative_draft_model_path=str(draft))
    assert EngineConfig(speculative_algorithm="eagle3", speculative_draft_model_path=str(draft)).draft_kind == "eagle3"
    other = tmp_path / "other"
    save_random_model(other, tiny_config("dense", vocab_size=256, num_hidden_layers=4), seed=0)
    with pytest.raises(ValueError, match="vocab_size 512 differs from the target's 256"):
        make_engine(other, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft))
    with pytest.raises(FileNotFoundError, match="no EAGLE-3 draft"):
        make_engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))


def test_the_server_serves_an_eagle3_tree_with_sglangs_flags(target_and_draft: tuple[Path, Path]) -> None:
    """Over HTTP: SGLang's EAGLE3 flags (a draft path, a tree) start it; /generate returns what the plain engine
    returns, with SGLang's speculative keys; /get_server_info reports the flags."""
    import httpx

    from miles_rollout.launch import launch_server

    target, draft = target_and_draft
    plain = make_engine(target)
    reference = generate(plain, {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True})
    plain.shutdown()
    flags = ("--page-size", "16", "--num-kv-pages", "128", "--deterministic", "--speculative-algorithm", "EAGLE3",
             "--speculative-draft-model-path", str(draft), "--speculative-num-steps", "2", "--speculative-eagle-topk",
             "2", "--speculative-num-draft-tokens", "5")  # fmt: skip
    with launch_server(target, *flags, env={"OMP_NUM_THREADS": "1"}) as url:
        body = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        }
        out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert out["output_ids"] == reference[0].output_ids
    assert out["meta_info"]["spec_verify_ct"] >= 1
    assert (info["speculative_algorithm"], info["speculative_draft_model_path"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == ("EAGLE3", str(draft), 2, 5)  # fmt: skip


def test_the_eagle3_drafts_weights_travel_with_weight_updates(
    target_and_draft: tuple[Path, Path], tmp_path: Path
) -> None:
    """A weight update that carries the draft's tensors (`eagle3.*`, as the trainer sends them with
    spec.draft=eagle3) replaces the engine's draft: it then drafts exactly as a fresh engine on the new draft does
    (same proposals, same tokens); one that carries the policy alone leaves the draft as it is."""
    from miles_kernels import iter_buckets, load_eagle3

    target, first = target_and_draft
    second = tmp_path / "second"
    save_eagle3(new_eagle3(read_model_config(target), draft_vocab_size=300, seed=9), second)
    params = {"temperature": 0.0, "max_new_tokens": 16}

    def drafted(engine: Engine) -> list:
        """The draft tokens the engine proposed (random drafts are rarely accepted: their proposals tell them apart),
        and the outputs."""
        proposals: list = []
        drafter = engine.scheduler.drafter
        original = drafter.propose

        def recording(store, seqs, budgets):  # type: ignore[no-untyped-def]
            proposals.append(original(store, seqs, budgets))
            return proposals[-1]

        drafter.propose = recording  # type: ignore[method-assign]
        try:
            return [proposals, [r.output_ids for r in generate(engine, params)]]
        finally:
            drafter.propose = original  # type: ignore[method-assign]

    def spec(draft: Path) -> dict:
        return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft)}

    references = {}
    for name, draft in (("first", first), ("second", second)):
        fresh = make_engine(target, **spec(draft))
        references[name] = drafted(fresh)
        fresh.shutdown()
    assert references["first"][0] != references["second"][0]  # the drafts differ
    engine = make_engine(target, **spec(first))
    client = InProcessClient(engine)
    try:
        policy = [(n, t) for n, t in engine.weights.model.state_dict().items() if not n.startswith("eagle3.")]
        asyncio.run(client.update_weights_from_buckets(iter_buckets(policy, version=1, bucket_bytes=50_000)))
        assert drafted(engine) == references["first"]
        new = load_eagle3(second, read_model_config(target), KERNEL).state_dict()
        tensors = policy + [(f"eagle3.{n}", t) for n, t in new.items()]  # what the trainer sends
        asyncio.run(client.update_weights_from_buckets(iter_buckets(tensors, version=2, bucket_bytes=50_000)))
        assert drafted(engine) == references["second"]
    finally:
        engine.shutdown()
