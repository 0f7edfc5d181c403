"""On-policy distillation (the `opd` section; docs/algorithms.md, "On-policy distillation"): a teacher scores the
student's own rollouts, and the per-token reverse KL between them becomes (part of) the learning signal.

After a step's rollout, rewards and filters (`generate_batch`), the teacher gets every trained sample's prompt plus
response (`/generate` with `max_new_tokens` 0, `return_logprob` and `logprob_start_len`, as slime's OPD reward
function asks an SGLang teacher) and returns the log-prob of each response token, stored as
`Sample.teacher_logprobs`. Before the optimizer steps (steps.py), each trained token's advantage becomes

    A'_t = A_t - kl_coef * (log pi_student(y_t) - log pi_teacher(y_t))

(slime's `apply_opd_kl_to_advantages`: the sampled-token estimate of KL(student || teacher), Tinker's on-policy
distillation), with A_t the configured estimator's advantage, or 0 with `opd.task_reward=false` (pure
distillation). The student's log-probs are the rollout's when they equal the trainer's bit for bit (true
on-policy), else the trainer's recomputed ones.

The teacher is an embedded engine in this process (`opd.teacher`: a model directory, or a built-in policy
bootstrapped with its own knobs) or any SGLang-compatible server (`opd.teacher_url`: SGLang, a router,
`miles-rollout serve`). Its tokenizer must be the student's: checked at start-up (the vocabularies of the two
directories, or a probe text the server tokenizes), refused by name otherwise. A scoring call that fails (after
`opd.max_retries` retries of a connection error, a timeout, a 5xx or a 429) drops its prompt group from the step,
logged and counted; a step whose every group failed stops the run (training without the teacher would not be
distillation), to be resumed from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from miles_contracts import GenerateClient, GenerateRequest, Sample, SamplingParams
from miles_orchestrator.config import RunConfig
from miles_rollout import Client, Engine, EngineConfig, InProcessClient, RolloutClientError

Scores = tuple[list[float], list[list[tuple[int, float]]] | None]  # a sample's teacher log-probs, and its top-k
PROBE_TEXT = 'What is 12 + 34? The answer is 46.\nHello, world! 0123456789 (x*y - z) = 7; "quoted" text.'


class TeacherError(RuntimeError):
    """The teacher could not score a prompt group (after retries): the group is not trained."""


class Teacher:
    """Scores samples with the teacher (see the module docstring). `client_factory` opens a `GenerateClient` for
    one step's calls (the embedded engine's, or an HTTP client of `opd.teacher_url`)."""

    def __init__(
        self, cfg: RunConfig, client_factory: Callable[[], contextlib.AbstractAsyncContextManager[GenerateClient]],
        description: str,
    ) -> None:  # fmt: skip
        self.opd, self.temperature = cfg.opd, cfg.rollout.temperature
        self.client_factory, self.description = client_factory, description

    async def score(self, batch: list[Sample]) -> tuple[list[Sample], list[str]]:
        """`batch` with `teacher_logprobs` on every sample, less the prompt groups the teacher could not score;
        and why each of those failed."""
        groups: dict[int, list[Sample]] = {}
        for sample in batch:
            groups.setdefault(sample.group_index, []).append(sample)
        limit = asyncio.Semaphore(self.opd.max_concurrency)
        async with self.client_factory() as client:
            results = await asyncio.gather(*(self._group(client, limit, g) for g in groups.values()))
        scored: dict[int, Sample] = {}
        errors = []
        for group, result in zip(groups.values(), results, strict=True):
            if isinstance(result, str):
                errors.append(f"prompt group {group[0].group_index}: {result}")
                continue
            for s, (logprobs, top) in zip(group, result, strict=True):
                scored[s.index] = s.model_copy(update={"teacher_logprobs": logprobs, "teacher_top_logprobs": top})
        return [scored[s.index] for s in batch if s.index in scored], errors

    async def _group(
        self, client: GenerateClient, limit: asyncio.Semaphore, group: list[Sample]
    ) -> list[Scores] | str:
        """The teacher's log-probs of each sample's response tokens (and with `opd.top_k` its top-k at each
        position), or why they could not be had."""
        todo = [s for s in group if s.response_tokens]
        out: dict[int, Scores] = {s.index: ([], [] if self.opd.top_k else None) for s in group}
        if not todo:
            return [out[s.index] for s in group]
        # logprob_start_len one before the response: servers differ on whether the first scored position has a
        # value (SGLang gives None at position 0 only), so the response's entries are the last ones whatever they do
        request = GenerateRequest(
            input_ids=[s.prompt_tokens + s.response_tokens for s in todo],
            sampling_params=SamplingParams(max_new_tokens=0, temperature=self.temperature),
            return_logprob=True, logprob_start_len=[len(s.prompt_tokens) - 1 for s in todo],
            top_logprobs_num=self.opd.top_k,
        )  # fmt: skip
        try:
            responses = await self._generate(client, limit, request)
            if len(responses) != len(todo):
                raise TeacherError(f"the teacher answered {len(responses)} sequences for {len(todo)}")
            for sample, response in zip(todo, responses, strict=True):
                meta = response.meta_info
                top = None
                if self.opd.top_k:
                    top = response_top_logprobs(sample, meta.input_top_logprobs or [], self.opd.top_k)
                out[sample.index] = (response_logprobs(sample, meta.input_token_logprobs or []), top)
        except (TeacherError, RolloutClientError) as error:
            return f"{self.description}: {error}"
        return [out[s.index] for s in group]

    async def _generate(self, client: GenerateClient, limit: asyncio.Semaphore, request: GenerateRequest) -> Any:
        for attempt in range(self.opd.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
            try:
                async with limit, asyncio.timeout(self.opd.timeout_s):
                    return await client.generate(request)
            except TimeoutError:
                failure: Exception = TeacherError(f"timed out after {self.opd.timeout_s:g}s (opd.timeout_s)")
            except RolloutClientError as error:
                if error.status_code is not None and error.status_code < 500 and error.status_code != 429:
                    raise  # the request is wrong for this teacher: asking again gets the same answer
                failure = error
        raise TeacherError(f"{failure} ({self.opd.max_retries + 1} attempt(s))")


def response_logprobs(sample: Sample, entries: Sequence[Sequence[Any]]) -> list[float]:
    """The response tokens' log-probs from a teacher's `input_token_logprobs` (entries (log-prob, token id, text)
    ending with the response's), checked against the tokens sent."""
    n = len(sample.response_tokens)
    tail = list(entries[-n:]) if len(entries) >= n else []
    if len(tail) != n:
        raise TeacherError(f"the teacher returned {len(entries)} input log-probs for a response of {n} tokens")
    ids = [int(entry[1]) for entry in tail]
    if ids != sample.response_tokens:
        raise TeacherError("the teacher scored other tokens than the response's (a different tokenizer or a server "
                           "that re-tokenizes input_ids)")  # fmt: skip
    if any(entry[0] is None for entry in tail):
        raise TeacherError("the teacher returned no log-prob for a response token")
    return [float(entry[0]) for entry in tail]


def response_top_logprobs(
    sample: Sample, entries: Sequence[Sequence[Sequence[Any]] | None], k: int
) -> list[list[tuple[int, float]]]:
    """The teacher's top-k (token id, log-prob) pairs at each response position, from its `input_top_logprobs`
    (one list of (log-prob, token id, text) per scored position, ending with the response's)."""
    n = len(sample.response_tokens)
    tail = list(entries[-n:]) if len(entries) >= n else []
    if len(tail) != n:
        raise TeacherError(f"the teacher returned {len(entries)} positions of top log-probs for a response of {n} "
                           "tokens (does it support top_logprobs_num?)")  # fmt: skip
    out = []
    for position in tail:
        pairs = [(int(e[1]), float(e[0])) for e in position or [] if e[0] is not None]
        if len(pairs) != k:
            raise TeacherError(f"the teacher returned {len(pairs)} top log-probs at a position, not opd.top_k={k}")
        out.append(pairs)
    return out


def opd_advantages(
    advantages: list[list[float]], batch: Sequence[Sample], student_logprobs: Sequence[Sequence[float]],
    kl_coef: float, task_reward: bool,
) -> tuple[list[list[float]], dict[str, float]]:  # fmt: skip
    """Each token's advantage less `kl_coef` times its reverse KL estimate, log pi_student - log pi_teacher (the
    estimator's advantage dropped with `task_reward=False`), and the step's metrics over trained tokens:
    `opd_reverse_kl` (token mean), `opd_reverse_kl_max`, `opd_teacher_logprob_mean`."""
    out, kls, teacher = [], [], []
    for sample, adv, student in zip(batch, advantages, student_logprobs, strict=True):
        if sample.teacher_logprobs is None:
            raise ValueError(f"sample {sample.index} has no teacher_logprobs: the teacher did not score it")
        row = []
        for a, s, t, m in zip(adv, student, sample.teacher_logprobs, sample.effective_loss_mask(), strict=True):
            kl = s - t
            row.append((a if task_reward else 0.0) - kl_coef * kl)
            if m:
                kls.append(kl)
                teacher.append(t)
        out.append(row)
    metrics = {
        "opd_reverse_kl": sum(kls) / max(len(kls), 1),
        "opd_reverse_kl_max": max(kls, default=0.0),
        "opd_teacher_logprob_mean": sum(teacher) / max(len(teacher), 1),
    }
    return out, metrics


def check_same_tokenizer(student: Any, student_dir: str, teacher_dir: str) -> None:
    """ValueError unless the teacher directory's tokenizer has the student's (`student`, the run's prompt encoder's)
    vocabulary and special tokens."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_dir)
    problems = []
    if student.get_vocab() != teacher.get_vocab():
        only = sorted(set(student.get_vocab().items()) ^ set(teacher.get_vocab().items()))[:3]
        problems.append(f"the vocabularies differ ({len(student)} vs {len(teacher)} tokens; e.g. {only})")
    if student.eos_token_id != teacher.eos_token_id:
        problems.append(f"EOS is {student.eos_token_id} vs {teacher.eos_token_id}")
    if problems:
        raise ValueError(
            f"opd.teacher: the teacher's tokenizer ({teacher_dir}) is not the student's ({student_dir}): "
            f"{'; '.join(problems)}. On-policy distillation scores the student's token ids with the teacher, so both "
            "must share one tokenizer; pick a teacher of the student's family"
        )


def check_server_tokenizer(
    url: str, tokenizer: Any, student_dir: str, headers: dict[str, str], timeout_s: float
) -> None:
    """ValueError unless the server at `url` answers /generate and tokenizes a probe text as the student's
    `tokenizer` does (with or without its special tokens: servers differ on adding BOS)."""
    text = PROBE_TEXT + "".join(tokenizer.all_special_tokens)
    body = {"text": text, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "return_logprob": True,
            "logprob_start_len": 0}  # fmt: skip
    try:
        response = httpx.post(url.rstrip("/") + "/generate", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as error:
        raise ValueError(f"opd.teacher_url={url!r}: no teacher answers there ({type(error).__name__}: {error}); "
                         "start it, or fix the host and port") from None  # fmt: skip
    if response.status_code != 200:
        raise ValueError(f"opd.teacher_url={url!r}: POST /generate answered {response.status_code}: "
                         f"{response.text[:200]!r}; is it an SGLang-compatible server (and opd.teacher_api_key_env "
                         "its key)?")  # fmt: skip
    try:
        reply = response.json()
        reply = reply[0] if isinstance(reply, list) else reply
        got = [int(entry[1]) for entry in reply["meta_info"]["input_token_logprobs"]]
    except (ValueError, KeyError, TypeError, IndexError):
        raise ValueError(
            f"opd.teacher_url={url!r}: /generate did not return meta_info.input_token_logprobs for return_logprob "
            "with logprob_start_len 0: it cannot score the student's tokens"
        ) from None
    wanted = [list(tokenizer.encode(text, add_special_tokens=flag)) for flag in (False, True)]
    if got not in wanted:
        raise ValueError(
            f"opd.teacher_url={url!r}: the teacher tokenizes a probe text as {got[:12]}... ({len(got)} tokens), the "
            f"student's tokenizer ({student_dir}) as {wanted[0][:12]}... ({len(wanted[0])} tokens): on-policy "
            "distillation needs the same tokenizer on both sides; serve a teacher of the student's family"
        )


def _api_key(env: str | None) -> str | None:
    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise ValueError(f"opd.teacher_api_key_env={env!r}: that environment variable is not set (or empty); "
                         f"export {env}=YOUR_KEY, or set opd.teacher_api_key_env=null")  # fmt: skip
    return key


def teacher_dir(cfg: RunConfig, log: Any) -> str:
    """The embedded teacher's model directory: `opd.teacher.path`, or the built-in policy bootstrapped with
    `opd.teacher`'s knobs (cached as the student's is)."""
    from miles_orchestrator.data.bootstrap import bootstrap_policy

    assert cfg.opd.teacher is not None
    if cfg.opd.teacher.path is not None:
        return cfg.opd.teacher.path
    log("opd: the teacher is the built-in policy bootstrapped with opd.teacher's settings")
    return bootstrap_policy(cfg.model_copy(update={"model": cfg.opd.teacher}), log=log)


@contextlib.contextmanager
def open_teacher(cfg: RunConfig, student_dir: str, tokenizer: Any, log: Any) -> Iterator[Teacher | None]:
    """The run's teacher (None without the opd section), its tokenizer checked against the student's (`tokenizer`,
    the run's prompt encoder's); an embedded engine stops on exit."""
    opd = cfg.opd
    if not opd.is_enabled:
        yield None
        return
    if opd.teacher_url is not None:
        url, key = opd.teacher_url, _api_key(opd.teacher_api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        check_server_tokenizer(url, tokenizer, student_dir, headers, opd.timeout_s)

        def remote() -> contextlib.AbstractAsyncContextManager[GenerateClient]:
            return Client(url, api_key=key, timeout=opd.timeout_s, max_connections=opd.max_concurrency)

        log(f"opd: teacher at {url} (kl_coef {opd.kl_coef:g}, task reward {'on' if opd.task_reward else 'off'})")
        yield Teacher(cfg, remote, f"teacher {url}")
        return
    directory = teacher_dir(cfg, log)
    check_same_tokenizer(tokenizer, student_dir, directory)
    began = time.perf_counter()
    e = cfg.rollout.engine
    engine = Engine(directory, cfg.kernel, EngineConfig(
        num_kv_pages=e.num_kv_pages, max_running_requests=e.max_running_requests,
        max_prefill_tokens=e.max_prefill_tokens, context_length=e.context_length, device=e.device, limits=e.limits,
    ))  # fmt: skip
    try:
        client = InProcessClient(engine)

        @contextlib.asynccontextmanager
        async def embedded() -> Any:
            yield client

        log(f"opd: embedded teacher engine on {directory} ({time.perf_counter() - began:.1f}s to load; kl_coef "
            f"{opd.kl_coef:g}, task reward {'on' if opd.task_reward else 'off'})")  # fmt: skip
        yield Teacher(cfg, embedded, f"teacher {directory}")
    finally:
        engine.shutdown()
