"""The run config's `reward` section: the built-in rewards, user code in reward workers, a remote reward server, a
reward model and a generative judge (miles_orchestrator.reward; docs/plugins.md)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from miles_contracts import is_plugin_path
from miles_orchestrator.config.sections import Section, is_http_url

BUILTIN_REWARD_NAMES = ("exact_match", "math", "task", "env")
HTTP_REWARD = "http"  # the built-in remote reward (miles_orchestrator.reward.http)
REWARD_MODEL = "reward_model"  # a sequence-classification reward model in the driver (reward/model.py)
JUDGE_REWARD = "judge"  # a generative judge: a served model's verdict, parsed (reward/judge.py)
DRIVER_REWARD_NAMES = (HTTP_REWARD, REWARD_MODEL, JUDGE_REWARD)  # scored without reward worker processes
DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the question from 0 (wrong or useless) to 10 (correct and complete).\n\n"
    "Question: {prompt}\n\nReference answer: {label}\n\nResponse: {response}\n\n"
    "Think briefly, then end with a line 'Score: N'."
)
DEFAULT_JUDGE_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"


class RewardSection(Section):
    """How responses are scored (step 3): user code runs in worker processes with a timeout; the http reward asks a
    server."""

    name: str = Field(
        default="task",
        description="'exact_match', 'math', 'task', 'env' (the episode's environment reward; needs "
        "rollout.agent.env), 'http' (a reward server at reward.url), 'reward_model' (a sequence-classification "
        "reward model at reward.model_path), 'judge' (a served model's verdict: reward.judge_url), or a "
        "'module:function' path.",
    )
    is_group: bool = Field(default=False, description="The function scores a whole prompt group at once.")
    timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds per reward call (http: per attempt) before it counts as failed."
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong punishment (verl's reward_model.overlong_buffer.len): a response longer "
        "than rollout.max_new_tokens - overlong_buffer loses overlong_penalty x (the excess / overlong_buffer) of "
        "reward, the whole penalty at max_new_tokens. 0: off.",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0, description="The overlong punishment at rollout.max_new_tokens (verl's penalty_factor)."
    )
    num_workers: int = Field(
        default=2,
        ge=1,
        le=256,
        description="Reward worker processes (math and module:function rewards; exact_match, task and env are "
        "scored in the driver, http, judge and reward_model by their servers or model).",
    )
    url: str | None = Field(
        default=None,
        description="The http reward's endpoint, e.g. http://127.0.0.1:8000/reward: each call POSTs the sample(s) as "
        "JSON there.",
    )
    health_url: str | None = Field(
        default=None,
        description="http reward: a URL that must answer GET with 2xx at start-up; null: a GET of reward.url must "
        "get any answer but 404.",
    )
    max_retries: int = Field(
        default=3, ge=0, le=20,
        description="http reward: extra attempts of a call after a connection error, a timeout, a 5xx or a 429 "
        "(never after another 4xx).",
    )  # fmt: skip
    backoff_s: float = Field(
        default=0.5, gt=0, description="http reward: wait before the first retry; doubles per retry."
    )
    max_backoff_s: float = Field(default=8.0, gt=0, description="http reward: the longest wait between retries.")
    max_concurrency: int = Field(
        default=32, ge=1, le=4096, description="http reward: most requests in flight at once."
    )
    api_key_env: str | None = Field(
        default=None,
        description="http reward / judge: environment variable holding an API key, sent as 'Authorization: Bearer "
        "KEY' (the key itself stays out of config files); null: no key.",
    )
    model_path: str | None = Field(
        default=None,
        description="reward_model: a Hugging Face sequence-classification directory (e.g. a "
        "Qwen3ForSequenceClassification reward model: AutoModelForSequenceClassification's format), run in the "
        "driver on the miles-kernels layers; the reward is its score (label 0) of the conversation.",
    )
    max_tokens_per_batch: int = Field(
        default=4096, ge=1, description="reward_model: tokens per forward (a longer sequence runs alone)."
    )
    judge_url: str | None = Field(
        default=None,
        description="judge: base URL of an OpenAI-compatible server (SGLang, vLLM, miles-rollout serve) whose "
        "/v1/chat/completions grades each response, e.g. http://127.0.0.1:30020.",
    )
    judge_model: str = Field(default="default", description="judge: the `model` field of each chat request.")
    judge_template: str = Field(
        default=DEFAULT_JUDGE_TEMPLATE,
        description="judge: the user message, a Python format string over {prompt}, {response} and {label}.",
    )
    judge_pattern: str = Field(
        default=DEFAULT_JUDGE_PATTERN,
        description="judge: a regular expression whose first group is the score (its last match in the answer).",
    )
    judge_max_score: float = Field(
        default=10.0, gt=0, description="judge: the reward is the parsed score / judge_max_score."
    )
    judge_max_new_tokens: int = Field(default=256, ge=1, description="judge: most tokens of a verdict.")

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value in (*BUILTIN_REWARD_NAMES, *DRIVER_REWARD_NAMES) or is_plugin_path(value):
            return value
        raise ValueError(
            f"reward.name={value!r}: use one of {[*BUILTIN_REWARD_NAMES, *DRIVER_REWARD_NAMES]} or a "
            "'module:function' path"
        )

    @field_validator("url", "health_url", "judge_url")
    @classmethod
    def _http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or is_http_url(value):
            return value
        raise ValueError(
            f"reward.{info.field_name}={value!r} is not an http(s) URL with a host; give e.g. "
            "http://127.0.0.1:8000/reward"
        )

    @model_validator(mode="after")
    def _http_settings(self) -> RewardSection:
        if self.name == HTTP_REWARD and self.url is None:
            raise ValueError(
                "reward.name=http needs reward.url, the endpoint that scores samples (e.g. "
                "reward.url=http://127.0.0.1:8000/reward)"
            )
        if self.name != HTTP_REWARD and (self.url is not None or self.health_url is not None):
            raise ValueError(
                f"reward.url / reward.health_url are for reward.name=http, not reward.name={self.name!r}; set "
                "reward.name=http or drop them"
            )
        needs = {REWARD_MODEL: ("model_path", self.model_path), JUDGE_REWARD: ("judge_url", self.judge_url)}
        for name, (field, value) in needs.items():
            if self.name == name and value is None:
                raise ValueError(f"reward.name={name} needs reward.{field}")
            if self.name != name and value is not None:
                raise ValueError(
                    f"reward.{field} is for reward.name={name}, not {self.name!r}: set the name or drop it"
                )
        if self.name in (REWARD_MODEL, JUDGE_REWARD) and self.is_group:
            raise ValueError(f"reward.name={self.name} scores each sample on its own: set reward.is_group=false")
        if self.name == JUDGE_REWARD:
            _check_judge(self.judge_template, self.judge_pattern)
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"reward.max_backoff_s={self.max_backoff_s:g} is below reward.backoff_s={self.backoff_s:g}; raise "
                "max_backoff_s or lower backoff_s"
            )
        return self


def _check_judge(template: str, pattern: str) -> None:
    """reward.judge_template formats with {prompt}, {response}, {label} only; judge_pattern has a score group."""
    import re
    import string

    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if "response" not in fields or not fields <= {"prompt", "response", "label"}:
        raise ValueError(
            f"reward.judge_template has fields {sorted(fields)}: it must use {{response}} and may use {{prompt}} "
            "and {label} (write a literal brace as {{ or }})"
        )
    try:
        groups = re.compile(pattern).groups
    except re.error as error:
        raise ValueError(f"reward.judge_pattern={pattern!r} is not a regular expression: {error}") from None
    if groups < 1:
        raise ValueError(f"reward.judge_pattern={pattern!r} has no group: put the score in one, e.g. 'Score: (\\d+)'")
