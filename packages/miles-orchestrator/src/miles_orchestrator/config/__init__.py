"""The run config (docs/architecture.md, "Config"): `RunConfig` (run.py) and its loading (loading.py), the sections
only the loop has (sections.py; the reward and opd sections: reward.py, opd.py), the rollout section (rollout.py)."""

from miles_orchestrator.config.loading import config_help, dump_config, load_config
from miles_orchestrator.config.reward import BUILTIN_REWARD_NAMES, HTTP_REWARD, RewardSection
from miles_orchestrator.config.run import RunConfig, check_batch_identity
from miles_orchestrator.config.sections import HF_PREFIX, DataSection, FilterSection, data_source_kind

__all__ = [
    "BUILTIN_REWARD_NAMES", "HF_PREFIX", "HTTP_REWARD", "DataSection", "FilterSection", "RewardSection", "RunConfig",
    "check_batch_identity", "config_help", "data_source_kind", "dump_config", "load_config",
]  # fmt: skip
