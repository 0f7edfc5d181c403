"""The run config's `opd` section: on-policy distillation from a teacher (miles_orchestrator.opd; docs/algorithms.md,
"On-policy distillation")."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from miles_orchestrator.config.sections import ModelSection, Section, is_http_url


class OPDSection(Section):
    """On-policy distillation (slime's --use-opd; miles_orchestrator.opd): a teacher scores the student's own
    rollouts and each trained token's advantage becomes A - kl_coef * (log pi_student - log pi_teacher); with top_k,
    a loss term of the teacher's top-k forward KL instead."""

    teacher: ModelSection | None = Field(
        default=None,
        description="An embedded teacher engine in the run: {path: HF model directory}, or the built-in policy "
        "bootstrapped with these model knobs (e.g. {bootstrap_num_layers: 8, bootstrap_target_pass_rate: 0.8}). "
        "null: no embedded teacher.",
    )
    teacher_url: str | None = Field(
        default=None,
        description="An SGLang-compatible teacher server's base URL (SGLang, a router, miles-rollout serve), e.g. "
        "http://127.0.0.1:30010: POST /generate with return_logprob and logprob_start_len.",
    )
    teacher_api_key_env: str | None = Field(
        default=None,
        description="teacher_url: environment variable holding its API key (sent as 'Authorization: Bearer KEY').",
    )
    kl_coef: float = Field(
        default=1.0, ge=0,
        description="Weight of the reverse KL in the advantage (slime's --opd-kl-coef); with top_k, of the top-k "
        "forward KL loss term (trainer.loss.opd_topk_coef).",
    )  # fmt: skip
    top_k: int = Field(
        default=0, ge=0, le=64,
        description="0: the sampled token's reverse KL enters the advantage. k > 0: the teacher returns its k most "
        "likely tokens at every response position (SGLang's top_logprobs_num) and the trainer adds kl_coef x "
        "sum_j p_T(j) (log p_T(j) - log p_S(j)) over them to the loss (verl's top-k forward KL); FSDP2 backend.",
    )  # fmt: skip
    task_reward: bool = Field(
        default=True,
        description="Keep the advantage estimator's advantage from the task reward and add the KL term; false: the "
        "KL term alone (pure distillation; rewards are still scored and logged).",
    )
    timeout_s: float = Field(default=120.0, gt=0, description="Seconds per teacher call (one prompt group).")
    max_retries: int = Field(
        default=3, ge=0, le=20,
        description="Extra attempts of a teacher call after a connection error, a timeout, a 5xx or a 429.",
    )  # fmt: skip
    max_concurrency: int = Field(default=16, ge=1, le=1024, description="Most teacher calls in flight at once.")

    @property
    def is_enabled(self) -> bool:
        return self.teacher is not None or self.teacher_url is not None

    @field_validator("teacher_url")
    @classmethod
    def _server_url(cls, value: str | None) -> str | None:
        if value is None or is_http_url(value):
            return value
        raise ValueError(f"opd.teacher_url={value!r} is not an http(s) URL with a host; give the server's base URL, "
                         "e.g. http://127.0.0.1:30010")  # fmt: skip

    @model_validator(mode="after")
    def _one_teacher(self) -> OPDSection:
        if self.teacher is not None and self.teacher_url is not None:
            raise ValueError(
                "opd.teacher (an embedded engine) and opd.teacher_url (a server) are two teachers: set one"
            )
        if self.top_k and not self.is_enabled:
            raise ValueError(
                f"opd.top_k={self.top_k} distills from a teacher's top-k: set opd.teacher or opd.teacher_url"
            )
        if self.teacher_api_key_env is not None and self.teacher_url is None:
            raise ValueError("opd.teacher_api_key_env is the key of opd.teacher_url: set the URL, or drop the key")
        return self
