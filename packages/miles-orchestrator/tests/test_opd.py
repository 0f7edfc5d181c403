"""On-policy distillation (miles_orchestrator.opd).

- The advantage against slime's `apply_opd_kl_to_advantages` (transcribed below), with and without the task reward.
- CPU numerics (in-process engines, one `miles-rollout serve` subprocess): a teacher that is the student's own
  model scores the student's rollouts with the rollout's log-probs bit for bit (a reverse KL of exactly 0); another
  teacher's log-probs equal that model's own scoring of each whole sequence, alone; the same teacher behind an HTTP
  server gives the same bits; tokenizers that differ are refused by name (two directories, or a server's probe).
- A teacher that fails: retried on a 5xx, not on a 4xx; a group it cannot score leaves the batch, the rest stays.
- The config's refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from miles_contracts import GenerateRequest, Sample, SamplingParams
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_orchestrator.config import load_config
from miles_orchestrator.opd import Teacher, opd_advantages, open_teacher
from miles_rollout import Engine, EngineConfig, InProcessClient, RolloutClientError
from miles_rollout.launch import launch_server


# slime (THUDM/slime, slime/backends/megatron_utils/loss.py), apply_opd_kl_to_advantages, its arithmetic
def slime_opd(advantages: list[torch.Tensor], student_log_probs: list[torch.Tensor],
              teacher_log_probs: list[torch.Tensor], opd_kl_coef: float) -> list[torch.Tensor]:  # fmt: skip
    reverse_kls = []
    for i, adv in enumerate(advantages):
        reverse_kl = student_log_probs[i] - teacher_log_probs[i]
        advantages[i] = adv - opd_kl_coef * reverse_kl
        reverse_kls.append(reverse_kl)
    return advantages


def sample(index: int, n: int, teacher: list[float] | None = None, mask: list[int] | None = None) -> Sample:
    return Sample(index=index, group_index=index // 2, prompt="p", prompt_tokens=[1, 2], response_tokens=[3] * n,
                  teacher_logprobs=teacher, loss_mask=mask)  # fmt: skip


def test_the_advantage_is_slimes_opd_penalty() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 1]
    adv = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    student = [-torch.rand(n, generator=generator, dtype=torch.float64) * 3 for n in lengths]
    teacher = [-torch.rand(n, generator=generator, dtype=torch.float64) * 3 for n in lengths]
    masks = [[1] * n for n in lengths]
    masks[2][4:] = [0, 0, 0]  # tool output: its KL stays out of the metrics, its advantage is shaped all the same
    batch = [sample(i, n, teacher[i].tolist(), masks[i]) for i, n in enumerate(lengths)]
    for coef in (1.0, 0.3):
        got, metrics = opd_advantages([a.tolist() for a in adv], batch, [s.tolist() for s in student], coef, True)
        want = slime_opd([a.clone() for a in adv], student, teacher, coef)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), w, rtol=0, atol=1e-15)
        alone, _ = opd_advantages([a.tolist() for a in adv], batch, [s.tolist() for s in student], coef, False)
        zero = slime_opd([torch.zeros_like(a) for a in adv], student, teacher, coef)
        for g, w in zip(alone, zero, strict=True):
            torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), w, rtol=0, atol=1e-15)
    kls = torch.cat([(s - t)[torch.tensor(m, dtype=torch.bool)] for s, t, m in zip(student, teacher, masks,
                                                                                  strict=True)])  # fmt: skip
    assert metrics["opd_reverse_kl"] == pytest.approx(float(kls.mean()), abs=1e-12)
    assert metrics["opd_reverse_kl_max"] == pytest.approx(float(kls.max()), abs=1e-12)
    with pytest.raises(ValueError, match="sample 0 has no teacher_logprobs"):
        opd_advantages([[0.0]], [sample(0, 1)], [[0.0]], 1.0, True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A student, another model on its tokenizer (the teacher), and a model on another tokenizer."""
    root = tmp_path_factory.mktemp("opd")
    tokenizer = build_tokenizer(vocab_size=300)
    dirs = {"student": root / "student", "teacher": root / "teacher", "foreign": root / "foreign"}
    save_random_model(dirs["student"], tiny_config("dense", vocab_size=len(tokenizer)), seed=2, tokenizer=tokenizer)
    save_random_model(dirs["teacher"], tiny_config("dense", vocab_size=len(tokenizer), num_hidden_layers=3), seed=7,
                      tokenizer=tokenizer)  # fmt: skip
    other = build_tokenizer(vocab_size=280)
    save_random_model(dirs["foreign"], tiny_config("dense", vocab_size=len(other)), seed=3, tokenizer=other)
    return dirs


def rollouts(cfg, student_dir: Path) -> list[Sample]:
    """Two prompt groups of two samples each, sampled by the student's engine with their log-probs."""
    engine = Engine(str(student_dir), cfg.kernel, EngineConfig(num_kv_pages=256))
    try:
        prompts = [[5, 9, 14, 22], [31, 8, 40]]
        params = SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=3)
        request = GenerateRequest(input_ids=[p for p in prompts for _ in range(2)], return_logprob=True,
                                  sampling_params=params)  # fmt: skip
        responses = asyncio.run(InProcessClient(engine).generate(request))
    finally:
        engine.shutdown()
    out = []
    for i, response in enumerate(responses):
        pending = Sample(index=i, group_index=i // 2, prompt="p", prompt_tokens=prompts[i // 2])
        out.append(pending.extended(response))
    assert all(s.response_tokens for s in out)
    return out


def teacher_cfg(*overrides: str):
    return load_config(None, ["rollout.temperature=1.0", "filter.dynamic_sampling=false", *overrides])


def score(cfg, student_dir: Path, batch: list[Sample]) -> tuple[list[Sample], list[str]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    with open_teacher(cfg, str(student_dir), tokenizer, log=lambda _: None) as teacher:
        assert teacher is not None
        return asyncio.run(teacher.score(batch))


def whole_sequence_logprobs(cfg, model_dir: Path, s: Sample) -> list[float]:
    """The model's log-probs of the response tokens, scoring the whole sequence from its first token, alone."""
    engine = Engine(str(model_dir), cfg.kernel, EngineConfig(num_kv_pages=256))
    try:
        request = GenerateRequest(input_ids=s.prompt_tokens + s.response_tokens, return_logprob=True,
                                  logprob_start_len=0, sampling_params=SamplingParams(max_new_tokens=0))  # fmt: skip
        (response,) = asyncio.run(InProcessClient(engine).generate(request))
    finally:
        engine.shutdown()
    entries = response.meta_info.input_token_logprobs or []
    return [float(e[0]) for e in entries[len(s.prompt_tokens) :]]


def test_embedded_and_served_teachers_score_the_students_tokens(models) -> None:
    cfg = teacher_cfg(f"opd.teacher.path={models['student']}")
    batch = rollouts(cfg, models["student"])
    itself, errors = score(cfg, models["student"], batch)  # the student's own model as its teacher
    assert not errors and [s.index for s in itself] == [0, 1, 2, 3]
    assert all(s.teacher_logprobs == s.rollout_logprobs for s in itself)  # bit for bit: a reverse KL of 0
    _, metrics = opd_advantages([[0.0] * len(s.response_tokens) for s in itself], itself,
                                [s.rollout_logprobs or [] for s in itself], 1.0, True)  # fmt: skip
    assert metrics["opd_reverse_kl"] == 0.0 and metrics["opd_reverse_kl_max"] == 0.0

    cfg = teacher_cfg(f"opd.teacher.path={models['teacher']}")
    embedded, errors = score(cfg, models["student"], batch)
    assert not errors
    for s in embedded:
        assert s.teacher_logprobs == whole_sequence_logprobs(cfg, models["teacher"], s)
        assert s.teacher_logprobs != s.rollout_logprobs

    # the run's kernels (deterministic): a standalone server defaults to fast mode, other GEMMs, other last bits
    with launch_server(models["teacher"], "--num-kv-pages", "256", "--deterministic") as url:
        served, errors = score(teacher_cfg(f"opd.teacher_url={url}"), models["student"], batch)
        assert not errors
        assert [s.teacher_logprobs for s in served] == [s.teacher_logprobs for s in embedded]
        with pytest.raises(ValueError, match=r"opd\.teacher_url=.*tokenizes a probe text as"):
            score(teacher_cfg(f"opd.teacher_url={url}"), models["foreign"], batch)
    with pytest.raises(ValueError, match=r"the teacher's tokenizer \(.*foreign\) is not the student's"):
        score(teacher_cfg(f"opd.teacher.path={models['foreign']}"), models["student"], batch)
    with pytest.raises(ValueError, match=r"opd\.teacher_url='http://127\.0\.0\.1:9/': no teacher answers there"):
        score(teacher_cfg("opd.teacher_url=http://127.0.0.1:9/", "opd.timeout_s=2"), models["student"], batch)


def test_the_teachers_top_k_comes_with_its_sampled_token_log_probs(models) -> None:
    """opd.top_k: each response position's k most likely teacher tokens (SGLang's top_logprobs_num), embedded and
    served alike, most likely first, agreeing with the sampled token's own log-prob where it is among them; the
    trainer's loss term takes opd.kl_coef, the advantage none of it."""
    cfg = teacher_cfg(f"opd.teacher.path={models['teacher']}", "opd.top_k=3", "opd.kl_coef=0.25")
    assert cfg.trainer.loss.opd_topk_coef == 0.25
    batch = rollouts(cfg, models["student"])
    embedded, errors = score(cfg, models["student"], batch)
    assert not errors
    for s in embedded:
        top = s.teacher_top_logprobs
        assert top is not None and len(top) == len(s.response_tokens) and all(len(row) == 3 for row in top)
        for token, logprob, row in zip(s.response_tokens, s.teacher_logprobs or [], top, strict=True):
            values = [lp for _, lp in row]
            assert values == sorted(values, reverse=True) and len({i for i, _ in row}) == 3
            assert values[0] >= logprob  # the sampled token is at most as likely as the teacher's first choice
            if token in dict(row):
                assert dict(row)[token] == logprob
    itself, _ = score(teacher_cfg(f"opd.teacher.path={models['student']}", "opd.top_k=64"), models["student"], batch)
    found = [(dict(row)[t], lp) for s in itself for t, lp, row in
             zip(s.response_tokens, s.teacher_logprobs or [], s.teacher_top_logprobs or [], strict=True)
             if t in dict(row)]  # fmt: skip
    assert found and all(a == b for a, b in found)  # the sampled tokens among the student's own top-64
    # the run's kernels (deterministic): a standalone server defaults to fast mode, other GEMMs, other last bits
    with launch_server(models["teacher"], "--num-kv-pages", "256", "--deterministic") as url:
        served, errors = score(teacher_cfg(f"opd.teacher_url={url}", "opd.top_k=3"), models["student"], batch)
    assert not errors and [s.teacher_top_logprobs for s in served] == [s.teacher_top_logprobs for s in embedded]
    without = teacher_cfg(f"opd.teacher.path={models['teacher']}")
    assert without.trainer.loss.opd_topk_coef == 0.0
    assert all(s.teacher_top_logprobs is None for s in score(without, models["student"], batch)[0])


class FlakyTeacher:
    """Answers each prompt group from a script: a status to fail with, or the response tokens' log-probs."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script, self.calls = script, {g: 0 for g in script}

    async def generate(self, request: GenerateRequest):  # type: ignore[no-untyped-def]
        from miles_contracts import GenerateResponse

        assert isinstance(request.input_ids, list) and isinstance(request.input_ids[0], list)
        group = request.input_ids[0][0]  # the tests' prompts start with their group index
        self.calls[group] += 1
        status = self.script[group][self.calls[group] - 1] if self.calls[group] <= len(self.script[group]) else 200
        if status != 200:
            raise RolloutClientError("scripted failure", endpoint="/generate", status_code=status)
        return [
            GenerateResponse.model_validate(
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "id": "x",
                        "finish_reason": {"type": "length", "length": 0},
                        "prompt_tokens": len(ids),
                        "completion_tokens": 0,
                        "cached_tokens": 0,
                        "input_token_logprobs": [[-0.5, t, None] for t in ids[len(ids) - 3 :]],
                    },
                }
            )
            for ids in request.input_ids
        ]


def test_a_failing_teacher_is_retried_on_5xx_and_its_group_dropped_on_4xx() -> None:
    cfg = teacher_cfg("opd.teacher_url=http://127.0.0.1:1", "opd.max_retries=2")
    flaky = FlakyTeacher({0: [503, 500], 1: [400], 2: [502, 502, 502]})

    @contextlib.asynccontextmanager
    async def client():  # type: ignore[no-untyped-def]
        yield flaky

    teacher = Teacher(cfg, client, "teacher test")
    batch = [Sample(index=i, group_index=g, prompt="p", prompt_tokens=[g, 7], response_tokens=[4, 5, 6])
             for g in range(3) for i in (2 * g, 2 * g + 1)]  # fmt: skip
    scored, errors = asyncio.run(teacher.score(batch))
    assert [s.index for s in scored] == [0, 1]  # group 0 after two retries; 1 refused at once; 2 out of retries
    assert all(s.teacher_logprobs == [-0.5] * 3 for s in scored)
    assert flaky.calls == {0: 3, 1: 1, 2: 3}
    assert len(errors) == 2 and "HTTP 400" in errors[0] and "(3 attempt(s))" in errors[1]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [(["opd.teacher.path=/m", "opd.teacher_url=http://h:1"], "are two teachers"),
     (["opd.teacher_url=http://h:1", "opd.task_reward=false"], r"set filter\.dynamic_sampling=false"),
     (["opd.teacher_api_key_env=KEY"], "is the key of opd.teacher_url"),
     (["opd.teacher_url=http://h:1", "opd.task_reward=false", "filter.dynamic_sampling=false",
       "trainer.advantage_estimator=gae"], "PPO's critic would learn"),
     (["opd.teacher_url=ftp://h"], "is not an http"),
     (["model.path=/mine", "opd.teacher.bootstrap_num_layers=8"], "give the teacher's directory"),
     (["opd.top_k=4"], r"distills from a teacher's top-k: set opd\.teacher"),
     (["opd.teacher_url=http://h:1", "opd.top_k=4", "trainer.backend.name=megatron"],
      r"does not support opd\.top_k"),
     (["opd.teacher_url=http://h:1", "opd.top_k=4", "trainer.loss.opd_topk_coef=2"], "opd_topk_coef")],
)  # fmt: skip
def test_the_config_refuses_what_opd_cannot_do(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
    assert not load_config(None, []).opd.is_enabled
