"""CPU tier: tree drafting (`speculative_eagle_topk` > 1; draft_tree.py, speculative.py) with the MTP draft and an
EAGLE-3 draft, dense and MoE.

What a user relies on: with a draft tree the engine emits exactly what it emits without a draft — tokens, log-probs
(the verify rows' logits bit for bit: tree attention puts every key at its own position), top log-probs, finish
reasons — at temperature 0 and seeded temperature > 0, also when the accepted path runs through a branch other than
the first (its keys are then copied into the sequence's pages) and across a retract. Scratch pages go back after
every step. A random draft is rarely right, so an oracle tree (the reference continuation always on the last child,
a wrong sibling before it, wrong at some levels) drives long accepted runs through the later branches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, new_eagle3, read_model_config, save_eagle3
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig, InProcessClient
from miles_rollout.draft_tree import DraftTree

PROMPTS = [[(3 * i + 1) % 500 for i in range(21)], [7, 8, 9], [(11 * i) % 500 for i in range(32)]]
KERNEL = KernelConfig(mode="deterministic", page_size=16)


def test_a_tree_lays_out_its_branches_on_their_own_pages() -> None:
    """root 5 -> (a 6 -> c 8 -> d 9, b 7 -> e 10): two branches; the second diverges at depth 1 inside page 0."""
    tree = DraftTree([5, 6, 8, 9, 7, 10], [-1, 0, 1, 2, 0, 4])
    assert tree.depths == [0, 1, 2, 3, 1, 2] and tree.leaves() == [3, 5] and tree.drafted(5) == [7, 10]
    fresh = iter(range(100, 200))
    tree.lay_out(n=13, pages=[1, 2, 3], page_size=8, take=lambda count: [next(fresh) for _ in range(count)])
    first, second = tree.branches
    assert (first.first, first.prefix, first.table) == (0, 13, [1, 2, 3])
    # branch 1: nodes 4, 5 at positions 14, 15 (page 1, offsets 6, 7): page 0 shared, page 1 its own scratch copy
    assert (second.first, second.prefix, second.table, second.scratch) == (4, 14, [1, 100], [100])
    assert tree.own_lengths() == [4, 2] and tree.branch_of(3) == 0 and tree.branch_of(5) == 1
    assert tree.page_copies(8) == [(2, 100)]  # positions 8 .. 12 of the prompt, into the scratch page
    assert tree.copy_writes(13, 8) == [(0, 100, 5)]  # the root (position 13), read by branch 1 from its page
    assert tree.accept_path([7, 0, 0, 0, 10, 11]) == [0, 4, 5]  # the second branch, to its leaf
    assert tree.accept_path([6, 8, 1, 0, 0, 0]) == [0, 1, 2]
    assert tree.pages_to_keep([0, 4, 5], 8, 13, [1, 2, 3]) == [(100, 2)]
    assert tree.pages_to_keep([0, 1, 2], 8, 13, [1, 2, 3]) == []


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"tree-{request.param}")
    config = tiny_config(request.param, vocab_size=512, max_position_embeddings=512, num_hidden_layers=4,
                         num_nextn_predict_layers=1)  # fmt: skip
    save_random_model(root / "model", config, seed=1, tokenizer=build_tokenizer(save_dir=root / "model"))
    save_eagle3(new_eagle3(read_model_config(root / "model"), seed=2), root / "eagle3")
    return root / "model", root / "eagle3"


def make_engine(model_dir: Path, **engine: object) -> Engine:
    return Engine(str(model_dir), KERNEL, EngineConfig(num_kv_pages=160, **engine))  # type: ignore[arg-type]


def generate(engine: Engine, params: dict) -> list:
    request = GenerateRequest(input_ids=PROMPTS, sampling_params=SamplingParams(**params), return_logprob=True,
                              top_logprobs_num=2)  # fmt: skip
    return asyncio.run(InProcessClient(engine).generate(request))


def summary(responses: list) -> list:
    return [(r.output_ids, r.meta_info.finish_reason, r.meta_info.output_token_logprobs,
             r.meta_info.output_top_logprobs) for r in responses]  # fmt: skip


@pytest.mark.parametrize("draft", ["mtp", "eagle3"])
@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0, "max_new_tokens": 36, "n": 2},
     {"temperature": 1.0, "max_new_tokens": 36, "n": 2, "sampling_seed": 3, "top_k": 40}],
    ids=["greedy", "seeded"],
)  # fmt: skip
def test_tree_drafting_emits_what_plain_decoding_emits(
    model_dirs: tuple[Path, Path], draft: str, params: dict, oracle_trees
) -> None:  # type: ignore[no-untyped-def]
    model, eagle3 = model_dirs
    plain = make_engine(model)
    reference = generate(plain, params)
    plain.shutdown()
    spec = {"speculative_algorithm": "NEXTN"} if draft == "mtp" else {
        "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(eagle3)}  # fmt: skip
    engine = make_engine(model, **spec, speculative_num_steps=3, speculative_eagle_topk=3,
                         speculative_num_draft_tokens=8)  # fmt: skip
    try:
        responses = generate(engine, params)  # the real draft's trees
        assert summary(responses) == summary(reference)
        n = params["n"]
        continuations = {(tuple(PROMPTS[i // n]), i % n): r.output_ids for i, r in enumerate(reference)}
        engine.scheduler.drafter = oracle_trees(engine.scheduler.drafter, continuations)
        oracle = generate(engine, params)
        assert summary(oracle) == summary(reference)
        assert any(len(r.meta_info.spec_accept_histogram) == 4 for r in oracle)  # 3 levels accepted in one step
        stats = engine.scheduler.stats()
        assert stats["num_running"] == 0 and stats["num_used_pages"] == stats["num_cached_pages"]  # scratch returned
    finally:
        engine.shutdown()


def test_a_tree_run_retracted_midway_continues_exactly(model_dirs: tuple[Path, Path]) -> None:
    model, _ = model_dirs
    params = {"temperature": 1.0, "max_new_tokens": 40, "n": 2, "sampling_seed": 7, "ignore_eos": True}
    plain = make_engine(model)
    reference = generate(plain, params)
    plain.shutdown()
    engine = make_engine(model, speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=2)

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
        assert summary(asyncio.run(paused_midway())) == summary(reference)
    finally:
        engine.shutdown()


def test_trees_shrink_to_a_chain_when_no_scratch_page_is_spare(model_dirs: tuple[Path, Path]) -> None:
    """A KV store with no page to spare beyond the requests' reservations: every step still verifies (its first
    branch), and the outputs are those of plain decoding."""
    model, _ = model_dirs
    params = {"temperature": 0.0, "max_new_tokens": 30, "n": 2}
    plain = make_engine(model)
    reference = generate(plain, params)
    plain.shutdown()
    engine = Engine(str(model), KERNEL, EngineConfig(num_kv_pages=17, speculative_algorithm="NEXTN",
                                                     speculative_num_steps=3, speculative_eagle_topk=4))  # fmt: skip
    try:
        assert summary(generate(engine, params)) == summary(reference)
    finally:
        engine.shutdown()
