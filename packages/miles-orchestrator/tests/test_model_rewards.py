"""Model-based rewards: the reward model (`reward.name=reward_model`) and the generative judge (`reward.name=judge`).

- CPU numerics: a random `Qwen3ForSequenceClassification` saved by transformers, with a chat-template tokenizer,
  scores each sample of a batch as transformers' own forward does on the conversation rendered by its chat template
  (to float32 rounding), whatever the micro-batching; a sample past the model's context and a forward past the
  timeout fail their samples only.
- The judge against a scripted OpenAI-compatible server on 127.0.0.1 (the standard library's): the rendered
  template in a greedy chat request, the score parsed and scaled, an answer without a score or out of range failing
  its sample, a 5xx retried; and against a real `miles-rollout serve` (its /v1/chat/completions), whose random
  model's answer carries no score: the sample fails quoting it.
- The config's refusals.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_contracts import ChatMessage, Sample, SampleStatus
from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer, random_model, save_random_model, tiny_config
from miles_orchestrator.config import RewardSection, load_config
from miles_orchestrator.reward.pool import RewardPool, check_reward

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A random Qwen3ForSequenceClassification saved by transformers, with a chat-template tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("rm")
    tokenizer = build_tokenizer(vocab_size=300)
    hf = random_model(tiny_config("dense", vocab_size=len(tokenizer)), seed=0).config.to_hf(dtype="float32")
    hf |= {"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1,
           "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def samples() -> list[Sample]:
    chat = [ChatMessage(role="user", content="What is 2 + 3?")]
    return [Sample(index=i, group_index=i, prompt=p, response=r, label="5")
            for i, (p, r) in enumerate([("What is 2 + 3?", "5"), (chat, "It is 5."), ("Say hi", "hi there"),
                                        (chat, "6")])]  # fmt: skip


def test_the_reward_model_scores_as_transformers(reward_model_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    scores = {}
    for max_tokens in (4096, 20):  # one forward, or one per sample
        cfg = RewardSection(name="reward_model", model_path=str(reward_model_dir), max_tokens_per_batch=max_tokens)
        check_reward(cfg)
        with RewardPool.from_config(cfg, KERNEL) as pool:
            batch = samples()
            stats = asyncio.run(pool.score(batch))
            encoded = [pool.remote.encode(s) for s in batch]  # type: ignore[union-attr]
        assert stats.num_failed == 0
        scores[max_tokens] = [s.reward for s in batch]
    assert scores[4096] == scores[20]  # batch-invariant
    for ids, reward in zip(encoded, scores[20], strict=True):
        assert ids[-1] != reference.config.pad_token_id
        with torch.no_grad():
            want = float(reference(torch.tensor([ids])).logits[0, 0])
        assert reward == pytest.approx(want, abs=1e-5)
    assert len(set(scores[20])) == 4


def test_the_reward_model_fails_a_sample_not_the_run(reward_model_dir: Path) -> None:
    cfg = RewardSection(name="reward_model", model_path=str(reward_model_dir))
    with RewardPool.from_config(cfg, KERNEL) as pool:
        batch = samples()
        batch[2].response = "hi " * 2500  # past the model's context (4096 positions)
        stats = asyncio.run(pool.score(batch))
        assert stats.num_failed == 1 and batch[2].status == SampleStatus.FAILED and "its context is" in batch[2].error
        assert all(s.status != SampleStatus.FAILED for i, s in enumerate(batch) if i != 2)
        pool.remote.timeout_s = 1e-4  # type: ignore[union-attr]
        again = samples()
        stats = asyncio.run(pool.score(again))
        assert stats.num_timeouts == 4 and all("timed out" in (s.error or "") for s in again)


class JudgeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), JudgeHandler)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.failed_once: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class JudgeHandler(BaseHTTPRequestHandler):
    """Answers by the response under judgement: `good` scores 7, `bad` 0, `none` without a score, `huge` 42;
    `flaky` fails with 503 once, then scores 5."""

    server: JudgeServer

    def do_GET(self) -> None:
        self.answer(200 if self.path == "/v1/models" else 404, {"data": [{"id": "judge"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        response = text.split("Response: ")[1].split("\n")[0]
        with self.server.lock:
            self.server.bodies.append(body)
            first = response == "flaky" and response not in self.server.failed_once
            self.server.failed_once.add(response)
        if first:
            self.answer(503, {"detail": "busy"})
            return
        verdict = {"good": "Fine work.\nScore: 7", "bad": "Score: 3 at first, but wrong: Score: 0", "none": "Hmm.",
                   "huge": "Score: 42", "flaky": "Score: 5"}[response]  # fmt: skip
        self.answer(200, {"choices": [{"message": {"role": "assistant", "content": verdict}}]})

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def judge() -> Iterator[JudgeServer]:
    server = JudgeServer()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_judge_grades_with_the_template_and_the_pattern(judge: JudgeServer) -> None:
    cfg = RewardSection(name="judge", judge_url=judge.url, judge_model="grader", backoff_s=0.01)
    check_reward(cfg)
    batch = [Sample(index=i, group_index=0, prompt="What is 2 + 3?", label="5", response=r)
             for i, r in enumerate(["good", "bad", "none", "huge", "flaky"])]  # fmt: skip
    with RewardPool.from_config(cfg) as pool:
        stats = asyncio.run(pool.score(batch))
    assert [s.reward for s in batch] == [0.7, 0.0, 0.0, 0.0, 0.5]  # "bad": the last match counts
    assert [s.status == SampleStatus.FAILED for s in batch] == [False, False, True, True, False]
    assert "has no score" in (batch[2].error or "") and "'Hmm.'" in (batch[2].error or "")
    assert "outside [0, 10]" in (batch[3].error or "") and stats.num_failed == 2
    body = judge.bodies[0]
    assert body["model"] == "grader" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert "Question: What is 2 + 3?" in body["messages"][0]["content"]
    assert "Reference answer: 5" in body["messages"][0]["content"]
    assert sum(1 for b in judge.bodies if "Response: flaky" in b["messages"][0]["content"]) == 2  # a 503 retried


def test_the_judge_speaks_to_a_real_server(tmp_path) -> None:
    from miles_rollout.launch import launch_server

    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(tmp_path / "judge", tiny_config("dense", vocab_size=len(tokenizer)), seed=4, tokenizer=tokenizer)
    with launch_server(tmp_path / "judge", "--num-kv-pages", "256") as url:
        cfg = RewardSection(name="judge", judge_url=url, judge_max_new_tokens=8)
        check_reward(cfg)
        batch = [Sample(index=0, group_index=0, prompt="What is 2 + 3?", label="5", response="5")]
        with RewardPool.from_config(cfg) as pool:
            asyncio.run(pool.score(batch))
    assert batch[0].status == SampleStatus.FAILED and "has no score" in (batch[0].error or "")  # a random model
    with pytest.raises(ValueError, match=r"reward\.judge_url .*no reward server answers"):
        check_reward(cfg)  # the server is gone


@pytest.mark.parametrize(
    ("overrides", "match"),
    [(["reward.name=reward_model"], "needs reward.model_path"),
     (["reward.name=judge"], "needs reward.judge_url"),
     (["reward.model_path=/m"], "is for reward.name=reward_model"),
     (["reward.name=judge", "reward.judge_url=http://h:1", "reward.judge_template=Rate {answer}"],
      "must use {response}"),
     (["reward.name=judge", "reward.judge_url=http://h:1", "reward.judge_pattern=score=\\d+"], "has no group"),
     (["reward.name=reward_model", "reward.model_path=/m", "reward.is_group=true"], "scores each sample")],
)  # fmt: skip
def test_the_config_refuses_what_model_rewards_cannot_do(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
