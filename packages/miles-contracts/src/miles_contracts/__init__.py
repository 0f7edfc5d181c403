"""miles-contracts: the data that crosses Miles packages (pure Python + pydantic, no torch).

- `Sample`: one prompt/response through the RL data path (`Sample.extended` appends an engine response).
- `GenerateRequest` / `SamplingParams` / `GenerateResponse` / `MetaInfo`: SGLang's `/generate` schema.
- Plug-in Protocols (`RewardFn`, `GroupRewardFn`, `DataSource`, `RolloutFn`, `SampleFilter`), `load_plugin` and
  `PluginPath` (a config field holding a `module:function` path).
- The environment interface of agentic rollouts: `Environment`, `AgentMessage`, `ToolCall`, `StepResult`.
"""

from miles_contracts.environment import (
    AgentMessage,
    Environment,
    Observation,
    StepResult,
    ToolCall,
    observation_messages,
)
from miles_contracts.generate import (
    MAX_NEW_TOKENS_LIMIT,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    LogprobEntry,
    MetaInfo,
    SamplingParams,
)
from miles_contracts.plugins import (
    DataSource,
    GenerateClient,
    GroupRewardFn,
    PluginPath,
    RewardFn,
    RolloutFn,
    SampleFilter,
    is_plugin_path,
    load_plugin,
)
from miles_contracts.sample import STATUS_OF_FINISH, ChatMessage, FinishReasonType, Sample, SampleStatus
from miles_contracts.weight_version import (
    WeightVersion,
    reported_weight_version,
    version_string,
    weight_version_value,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_NEW_TOKENS_LIMIT",
    "STATUS_OF_FINISH",
    "AgentMessage",
    "ChatMessage",
    "DataSource",
    "Environment",
    "FinishReason",
    "FinishReasonType",
    "GenerateClient",
    "GenerateRequest",
    "GenerateResponse",
    "GroupRewardFn",
    "LogprobEntry",
    "MetaInfo",
    "Observation",
    "PluginPath",
    "RewardFn",
    "RolloutFn",
    "Sample",
    "SampleFilter",
    "SampleStatus",
    "SamplingParams",
    "StepResult",
    "ToolCall",
    "WeightVersion",
    "is_plugin_path",
    "load_plugin",
    "observation_messages",
    "reported_weight_version",
    "version_string",
    "weight_version_value",
]
